-- KEYS: lease keys. Returns the 0-based indexes of keys holding an unexpired lease.
local out = {}
for k, key in ipairs(KEYS) do
  if redis.call('ZCOUNT', key, '(' .. now, '+inf') > 0 then out[#out + 1] = k - 1 end
end
return out
