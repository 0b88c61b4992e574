-- KEYS: epoch, live, names, block keys in chain order. ARGV: own epoch, own num ('' if none).
-- Returns one string (a bulk reply parses far faster than a nested array in redis-py):
--   own_ok: u8 (0 when the caller's registration is gone: Redis restarted or flushed, or expired)
--   per matching holder: name length u16, name, length u32, worst tier u8, n_device u32,
--   n_host u32, n_disk u32 (all big endian; the layout of `_MATCH_HEAD` and `_MATCH_TAIL` in
--   kvpool/cluster_index.py).
local tier_of = {0, 1, 0, 2, 0, 1, 0}  -- tier mask -> best tier in it
local live = {}  -- holder num -> {prefix length, worst tier, n_device, n_host, n_disk}
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. now, '+inf')) do
  live[tonumber(m)] = {0, 0, 0, 0, 0}
end
-- A first small MGET: most misses end at block 0.
local n, i, going, batch = #KEYS - 3, 0, true, 8
while going and i < n do
  local vals = redis.call('MGET', unpack(KEYS, i + 4, math.min(i + batch, n) + 3))
  batch = 256
  for j = 1, #vals do
    i = i + 1
    local v, advanced = vals[j], false
    if v then
      for off = 1, #v, 5 do
        local a, b, c, d, m = string.byte(v, off, off + 4)
        local st = live[((a * 256 + b) * 256 + c) * 256 + d]
        if st and st[1] == i - 1 then
          local tier = tier_of[m]
          st[1] = i
          if tier > st[2] then st[2] = tier end
          st[3 + tier] = st[3 + tier] + 1
          advanced = true
        end
      end
    end
    if not advanced then going = false; break end
  end
end
local own = tonumber(ARGV[2])
local own_ok = redis.call('GET', KEYS[1]) == ARGV[1] and own and live[own]
local out = {own_ok and '\1' or '\0'}
for id, st in pairs(live) do
  if st[1] > 0 then
    local name = redis.call('HGET', KEYS[3], id)
    if name then
      out[#out + 1] = struct.pack('>H', #name) .. name ..
                      struct.pack('>I4BI4I4I4', st[1], st[2], st[3], st[4], st[5])
    end
  end
end
return table.concat(out)
