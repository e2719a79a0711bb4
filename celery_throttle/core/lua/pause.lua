--- @include "core/clock.lua"
--- @include "core/limits.lua"
--- @include "core/lease.lua"
--[[
celery_throttle pause.lua: admit nothing in the limits given for a while (a
provider answered 429 with Retry-After).  A rate bucket keeps its pause in
its value (bucket.lua), a concurrency limit in its meta hash; a longer pause
already set is kept.  Starts booked before the pause ends are void
(decide.lua).

KEYS and the limits' ARGV: limits.lua.
ARGV[1]  now (clock.lua)
ARGV[2]  for how long, us

Reply: the longest pause now in force among the limits, us
]]

now = clock_of(ARGV[1])
local till = now + tonumber(ARGV[2])
local L, n = limits_of(2)
local longest = 0
for i = 1, n do
  local lim = L[i]
  local ends
  if lim.concurrent then
    ends = math.max(meta_num(lim, 'pause'), till)
    redis.call('HSET', lim.meta, 'pause', us(ends))
    keep_at_least(lim.meta, math.ceil((ends - now) / 1000))
  else
    local tat, paused, shift = read_rate(lim.key)
    ends = math.max(paused, till)
    write_rate(lim.key, math.max(tat, now), ends, shift)
  end
  longest = math.max(longest, ends - now)
end
return longest
