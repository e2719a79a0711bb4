--- @include "core/clock.lua"
--- @include "core/limits.lua"
--- @include "core/bucket.lua"
--[[
celery_throttle follow.lua: the provider reported `remaining` units left until
its limit is full again, `reset` us from now: its own count, which callers
the gate cannot see spend too.  Spend at most that many before then, the
starts booked here included (the provider has not seen them): the TAT moves
to where unit remaining + 1 is admitted at the reset at the earliest, plus
the booked units.  Booked are the units past a full burst (starts never go
past it; bookings do), rounded up.  The move is a settlement's charge
(booked starts shift with it, keeping their order before the new ones); a
bucket already that strict is left alone.

KEYS and the limits' ARGV: limits.lua, rate limits only; a limit's cost
field is the units the provider says remain (>= 0).  The command's own:
KEYS[c+i-1] limit i's hold note (keys.py "h"): why the report holds it back,
            "remaining reset_us reported_us", expiring at the reset
ARGV[1]     now (clock.lua)
ARGV[2]     reset: us from now until the provider's limit is full again

Reply: the limits moved
]]

now = clock_of(ARGV[1])
local reset = tonumber(ARGV[2])
local L, n, _, own = limits_of(2)
local count = 0
for i = 1, n do
  local lim = L[i]
  local tat, paused, shift = read_rate(lim.key)
  local base = math.max(tat, now)
  local booked = math.max(0, tat - now - lim.burst * lim.interval)
  booked = math.ceil(booked / lim.interval) * lim.interval
  local target = now + reset - (lim.cost + 1 - lim.burst) * lim.interval + booked
  if target > base then
    write_rate(lim.key, target, paused, shift + target - base)
    count = count + 1
    -- Why, for `status`: gone when the provider's window resets.
    redis.call('SET', KEYS[own + i - 1], lim.cost .. ' ' .. us(now + reset) .. ' ' .. us(now),
               'PX', math.max(1, math.ceil(reset / 1000)))
  end
end
return count
