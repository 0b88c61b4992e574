-- Prelude of every script: the server clock in ms as `now` (holders never compare clocks).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
