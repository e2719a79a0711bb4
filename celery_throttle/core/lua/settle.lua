--- @include "core/clock.lua"
--- @include "core/limits.lua"
--- @include "core/bucket.lua"
--[[
celery_throttle settle.lua: a charge was an estimate; move each rate bucket
given by the difference.  A charge also shifts the starts booked before it
(bucket.lua).  A refund never makes the bucket fuller than full, and is given
only while no start is booked past the burst: with starts booked ahead, a
lower TAT would hand their times out a second time.

KEYS and the limits' ARGV: limits.lua; a limit's cost field is the
correction in units (actual - charged, may be negative).
ARGV[1]  now (clock.lua)

Reply: the limits settled
]]

now = clock_of(ARGV[1])
local L, n = limits_of(1)
local count = 0
for i = 1, n do
  local lim = L[i]
  if not lim.concurrent and lim.cost ~= 0 then
    local tat, paused, shift = read_rate(lim.key)
    if lim.cost > 0 then
      shift = shift + lim.cost * lim.interval
      tat = math.max(tat, now) + lim.cost * lim.interval
    elseif tat <= now + lim.burst * lim.interval then
      tat = math.max(math.max(tat, now) + lim.cost * lim.interval, now)
    end
    write_rate(lim.key, tat, paused, shift)
    count = count + 1
  end
end
return count
