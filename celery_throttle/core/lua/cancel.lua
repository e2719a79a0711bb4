--- @include "core/clock.lua"
--- @include "core/limits.lua"
--- @include "core/bucket.lua"
--[[
celery_throttle cancel.lua: give back a booking its holder will not use (a
waiter cancelled before its start).  Only the last booking of a bucket can be
given back, its TAT moved back to the booked start; a bucket that moved on since (any
later booking, charge or shift) keeps it: a hole costs throughput, a booked start
handed out twice would break the bound.

KEYS and the limits' ARGV: limits.lua.
ARGV[1]  now (clock.lua)
ARGV[2]  the booked start, us (decide.lua's reply)
ARGV[3]  its mask: bit i-1 set where it is booked in limit i
ARGV[4]  its epoch (epoch.lua): a booking from an older epoch is void already

Reply: the limits that gave it back
]]

now = clock_of(ARGV[1])
local start, mask, epoch = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local L, n = limits_of(4)
if start <= 0 or epoch ~= tonumber(redis.call('GET', KEYS[n + 1]) or 0) then
  return 0
end
local count = 0
for i = 1, n do
  local lim = L[i]
  if not lim.concurrent and booked_in(mask, i) then
    local tat, paused, shift = read_rate(lim.key)
    if tat == start + lim.cost * lim.interval and tat > now then
      write_rate(lim.key, math.max(start, now), paused, shift)
      count = count + 1
    end
  end
end
return count
