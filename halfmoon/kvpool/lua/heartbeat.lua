-- KEYS: epoch, live, names, dead. ARGV: own epoch, own num, ttl ms. Moves every expired holder to
-- `dead`, then extends own expiry. Returns 1, or 0 when the caller's registration is gone.
local score = redis.call('ZSCORE', KEYS[2], ARGV[2])
local ok = redis.call('GET', KEYS[1]) == ARGV[1] and score ~= false and tonumber(score) > now
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do
  redis.call('ZREM', KEYS[2], m)
  redis.call('HDEL', KEYS[3], m)
  redis.call('ZADD', KEYS[4], now, m)
end
if not ok then return 0 end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[2])
return 1
