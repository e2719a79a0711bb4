--- @include "core/clock.lua"
--- @include "core/limits.lua"
--- @include "core/lease.lua"
--[[
celery_throttle pause.lua: admit nothing in the limits given for a while (a
provider answered 429 with Retry-After).  A rate bucket keeps its pause in
its value (bucket.lua), a concurrency limit in its meta hash; a longer pause
already set is kept.  Starts booked before the pause ends are void
(decide.lua).  A provider's refusal for its quota also cuts the learned rate
of each limit given that learns (learn.lua); a cut limit's burst is spent,
so its next start is one new interval away; a cut soon after the last also
holds it (learn.lua's HOLD), the starts booked before it moved past the
hold.

KEYS and the limits' ARGV: limits.lua.
ARGV[1]  now (clock.lua)
ARGV[2]  for how long, us (0: no pause, a cut alone)
ARGV[3]  the refused request's age, us: it was admitted that long before now; -1
         when no request was refused (an operator's pause, a stop)

Reply: { the longest pause now in force among the limits (us), then each cut:
         "i before after", limit i's learned rate (starts a second) }
]]

now = clock_of(ARGV[1])
local till = now + tonumber(ARGV[2])
local age = tonumber(ARGV[3])
local L, n = limits_of(3)
local reply = { 0 }
for i = 1, n do
  local lim = L[i]
  local ends
  if lim.concurrent then
    ends = math.max(meta_num(lim, 'pause'), till)
    if ends > now then
      redis.call('HSET', lim.meta, 'pause', us(ends))
      keep_at_least(lim.meta, math.ceil((ends - now) / 1000))
    end
  else
    local tat, paused, shift = read_rate(lim.key)
    tat = math.max(tat, now)
    ends = math.max(paused, till)
    local before = lim.rate
    local hold = lim.learned and age >= 0 and learn_cut(lim, now - age)
    if hold then
      reply[#reply + 1] = string.format('%d %.6g %.6g', i, before, lim.rate)
      -- Starts booked at the old rate move past the hold with the TAT (bucket.lua's
      -- shift): sent at once after a cut, they would meet the same refusal.
      tat = math.max(tat + hold, now + hold + lim.burst * lim.interval)
      shift = shift + hold
    end
    write_rate(lim.key, tat, ends, shift)
  end
  reply[1] = math.max(reply[1], ends - now)
end
return reply
