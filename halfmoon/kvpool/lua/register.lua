-- KEYS: epoch, seq, names, live, dead. ARGV: epoch to create if none, holder key, old epoch, old
-- num ('' if none), ttl ms. Nums are unique within an epoch; the epoch changes when Redis loses
-- its data, so a num of an older epoch is never mistaken for the current holder of that num.
-- Retires the old num when it is of this epoch. Returns {epoch, new num}.
local epoch = redis.call('GET', KEYS[1])
if not epoch then
  epoch = ARGV[1]
  redis.call('SET', KEYS[1], epoch)
end
local num = redis.call('INCR', KEYS[2])
if num >= 4294967296 then return redis.error_reply('holder nums exhausted (u32)') end
redis.call('HSET', KEYS[3], num, ARGV[2])
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[5]), num)
if ARGV[4] ~= '' and ARGV[3] == epoch then
  redis.call('ZREM', KEYS[4], ARGV[4])
  redis.call('HDEL', KEYS[3], ARGV[4])
  redis.call('ZADD', KEYS[5], now, ARGV[4])
end
return {epoch, num}
