-- KEYS: epoch, own reservations, block keys. ARGV: own epoch, own packed num, tier, ttl ms, block
-- key prefix length. Returns {1, 0-based indexes of blocks newly reserved} (not published in
-- `tier` by this holder, not under a live reservation of it), or {0} when the caller's
-- registration is gone.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {0} end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local own, tier, ttl, plen = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local out = {1}
for k = 3, #KEYS do
  local v, held = redis.call('GET', KEYS[k]) or '', false
  for off = 1, #v, 5 do
    if string.sub(v, off, off + 3) == own then
      held = bit.band(string.byte(v, off + 4), 2 ^ tier) ~= 0
      break
    end
  end
  local member = string.char(tier) .. string.sub(KEYS[k], plen + 1)
  if not held and not redis.call('ZSCORE', KEYS[2], member) then
    redis.call('ZADD', KEYS[2], now + ttl, member)
    out[#out + 1] = k - 3
  end
end
if #out > 1 and redis.call('PTTL', KEYS[2]) < ttl then redis.call('PEXPIRE', KEYS[2], ttl) end
return out
