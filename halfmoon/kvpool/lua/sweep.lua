-- KEYS: live, block keys. Drops entries of holders that are not live. Returns entries dropped.
local alive = alive_in(KEYS[1])
local dropped = 0
for k = 2, #KEYS do
  local v = redis.call('GET', KEYS[k])
  if v then
    local parts = {}
    for off = 1, #v, 5 do
      local a, b, c, d = string.byte(v, off, off + 3)
      if alive(((a * 256 + b) * 256 + c) * 256 + d) then
        parts[#parts + 1] = string.sub(v, off, off + 4)
      else
        dropped = dropped + 1
      end
    end
    local nv = table.concat(parts)
    if nv == '' then
      redis.call('DEL', KEYS[k])
    elseif nv ~= v then
      redis.call('SET', KEYS[k], nv)
    end
  end
end
return dropped
