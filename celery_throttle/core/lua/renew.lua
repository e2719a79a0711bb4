--- @include "core/clock.lua"
--- @include "core/limits.lua"
--- @include "core/lease.lua"
--[[
celery_throttle renew.lua: keep a holder's leases in the concurrency limits
among those given (a running task's heartbeat) for another lease time; one
that expired and was reclaimed is taken again if a seat is free.

KEYS and the limits' ARGV: limits.lua.
ARGV[1]  now (clock.lua)
ARGV[2]  the holder (a task id)

Reply: the leases lost (every seat taken by others meanwhile): 0 is good
]]

now = clock_of(ARGV[1])
local holder = ARGV[2]
local L, n = limits_of(2)
local lost = 0
for i = 1, n do
  local lim = L[i]
  if lim.concurrent then
    reclaim(lim)
    if redis.call('ZSCORE', lim.key, holder)
        or redis.call('ZCARD', lim.key) < lim.seats then
      take(lim, holder, now)
    else
      lost = lost + 1
    end
  end
end
return lost
