-- Prelude: `alive_in(live_key)` gives `alive(id)`: is holder num `id` live (its expiry in the
-- zset `live_key` is after `now`)? Answers are cached for the rest of the script call.
local function alive_in(live_key)
  local cache = {}
  return function(id)
    local known = cache[id]
    if known == nil then
      local score = redis.call('ZSCORE', live_key, id)
      known = score ~= false and tonumber(score) > now
      cache[id] = known
    end
    return known
  end
end
