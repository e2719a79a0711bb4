--- @include "room/lines.lua"
--[[
celery_throttle due.lua: which of the limits' lines are due (see
room/lines.py).  The lines a seat was given back in (core/lua/release.lua)
are due now: they move from the freed set into the ready index first.

KEYS[1]  the ready index (line key -> when its limit admits a start, us)
KEYS[2]  the trip estimate (parking.py): a line is due this much ahead
         (lines.lua)
KEYS[3]  the freed set (core/keys.py freed_key): line keys, emptied here
ARGV[1]  the most lines returned
ARGV[2]  the most ahead, us (lines.MAX_AHEAD_US)
ARGV[3]  the dispatch lead, us (throttle_dispatch_lead)

Reply: { now, ahead, next, line 1, line 2, ... }: next is how long until the
earliest line not due yet (us), or -1
]]

now = server_us()
for _, line in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  local current = tonumber(redis.call('ZSCORE', KEYS[1], line))
  if redis.call('EXISTS', line) == 1 and (not current or current > now) then
    redis.call('ZADD', KEYS[1], now, line)
  end
end
redis.call('DEL', KEYS[3])
local ahead = ahead_of(KEYS[2], ARGV[2], ARGV[3])
local out = { now, ahead, -1 }
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now + ahead, 'LIMIT', 0,
                       tonumber(ARGV[1]))
for _, q in ipairs(due) do
  out[#out + 1] = q
end
if #due == 0 then
  out[3] = next_due(KEYS[1], ahead)
end
return out
