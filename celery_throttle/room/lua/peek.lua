--[[
celery_throttle peek.lua: the first parked tasks, with the server's clock
(read only; room/parking.py; why a script: state.lua).

KEYS[1]  the parked set    KEYS[2]  the messages hash
ARGV[1]  how many

Reply: { sec, usec, entry, score, message, entry, score, message, ... }
]]

local t = redis.call('TIME')
local out = { t[1], t[2] }
local first = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1, 'WITHSCORES')
for i = 1, #first, 2 do
  out[#out + 1] = first[i]
  out[#out + 1] = first[i + 1]
  out[#out + 1] = redis.call('HGET', KEYS[2], first[i]) or ''
end
return out
