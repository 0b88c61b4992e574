-- KEYS: live, names. Returns the names of live holders.
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
if #ids == 0 then return {} end
return redis.call('HMGET', KEYS[2], unpack(ids))
