-- KEYS: lease keys. ARGV: token, ttl ms. Adds the lease to every key, pruning expired ones.
local ttl = tonumber(ARGV[2])
for _, key in ipairs(KEYS) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  redis.call('ZADD', key, now + ttl, ARGV[1])
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
end
return 1
