-- KEYS: epoch, live, own reservations, block keys. ARGV: own epoch, own num, own packed num,
-- set mask, clear mask, block key prefix length. Sets/clears own tier bits, drops dead holders'
-- entries, ends the reservations of every touched tier. Returns 0 (nothing written) when the
-- caller's registration is gone.
local alive = alive_in(KEYS[2])
if redis.call('GET', KEYS[1]) ~= ARGV[1] or not alive(ARGV[2]) then return 0 end
local own, setm, clr = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local plen, touched = tonumber(ARGV[6]), bit.bor(setm, clr)
local has_rsv = redis.call('EXISTS', KEYS[3]) == 1
for k = 4, #KEYS do
  local key = KEYS[k]
  local v = redis.call('GET', key) or ''
  local parts, mine = {}, 0
  for off = 1, #v, 5 do
    local head = string.sub(v, off, off + 3)
    if head == own then
      mine = string.byte(v, off + 4)
    else
      local a, b, c, d = string.byte(head, 1, 4)
      if alive(((a * 256 + b) * 256 + c) * 256 + d) then
        parts[#parts + 1] = string.sub(v, off, off + 4)
      end
    end
  end
  mine = bit.bor(bit.band(mine, bit.bnot(clr)), setm)
  if mine ~= 0 then parts[#parts + 1] = own .. string.char(mine) end
  local nv = table.concat(parts)
  if nv == '' then redis.call('DEL', key) elseif nv ~= v then redis.call('SET', key, nv) end
  if has_rsv then
    local h = string.sub(key, plen + 1)
    for tier = 0, 2 do
      if bit.band(touched, 2 ^ tier) ~= 0 then
        redis.call('ZREM', KEYS[3], string.char(tier) .. h)
      end
    end
  end
end
return 1
