--- @include "core/clock.lua"
--[[
celery_throttle learn.lua: the learned rate of a limit that learns its
provider's quota (Limit(adaptive=True)), one copy for every script that
reads or charges such a bucket (limits.lua for the gate's commands;
room/lua/serve.lua, which dispatches a waiting task).

A learning limit is a rate limit whose interval field is "T/F" (limits.lua):
T the ceiling's interval (the configured or set rate: never above it), F
the floor's (never below it), us.  Its record, a hash beside its bucket
(keys.py "r"), outlives the bucket: a bucket's key expires once it drains,
and a learned rate must outlive an idle hour.  Fields:
  w      the rate (starts a second) at the last cut; absent: the ceiling
  t      use since the last cut, us; absent: K (the rate is w)
  ws, n  the window under way: its start (us), the units charged in it
  cut    when the last cut was made (us); 0: never
  held   until when the last hold lasts (us)
  why, at, from  the last move ("cut" or "raise"), when (us), and the rate
         before it
  mark   the rate last said (logged): a cut is said by the caller that made it,
         a climb past SAY of the mark by the next decision that admits a
         start at once (learn_admitted)

The law has CUBIC's shape (RFC 9438), on a rate instead of a window:

  rate = w * (1 + C * (t - K)^3),  K = cbrt((1 - BETA) / C)

clamped to [floor, ceiling].  A cut (a provider's quota refusal of a request
admitted after the last cut: one admitted before it was sent at the old
rate, which the cut already answered) sets w to the rate then and t to 0:
the rate drops to BETA of it, climbs back to it within K seconds of use,
stays near it, then probes above it.  The long stay near w keeps the
average near the quota with few refusals (plain AIMD's line averages
(1 + BETA) / 2 of it).  Use is counted per window: t grows by a window's
length only when at least USED of the rate was charged in it, so an idle or
half-idle fleet does not climb; and it stops growing at the ceiling, so a
raised ceiling is climbed from there.  A cut within HOLD of the last one
(the quota fell: requests admitted at the new rate are refused too) also
holds the limit for HOLD, so that the provider's own window of past
requests drains instead of refusing every request of a cut after a cut.

BETA and K were chosen against a sliding-window provider whose quota is a
third of the ceiling, then halved, then restored (benchmarks/adaptive.py,
BENCHMARKS.md section 11): a lower BETA averages further under the quota, a
shorter K probes above it (and is refused) more often, a longer one climbs
back too slowly.  CUBIC's fast convergence (a lower w after a cut under the
last one) left the rate under a halved quota for longer, and is not used:
one rate serves the whole fleet, so there is no other flow to make room for.
]]

local LEARN = {
  BETA = 0.85,          -- a cut keeps this share of the rate
  K = 18,               -- seconds of use to climb back to the rate of the cut
  HOLD = 1000000,       -- us: a cut this soon after the last one holds the limit this long
  WINDOW = 1000000,     -- us: use is judged per window of at least this
  MOST = 2000000,       -- us: the most use one window adds (a long one was not all use)
  USED = 0.5,           -- the share of the rate a window must use to count
  SAY = 0.1,            -- a move this far from the rate last said is said
  KEEP_MS = 604800000,  -- the record's life after its last write: a week
}
LEARN.C = (1 - LEARN.BETA) / LEARN.K ^ 3
-- The moves to say in this call's reply: { limit, rate said before, rate now }.
local LEARN_MOVES = {}

-- "T/F" -> T, F (us); nil for a limit that does not learn.
local function learning_of(field)
  local ceiling, floor = string.match(field, '^(%d+)/(%d+)$')
  if ceiling then
    return tonumber(ceiling), tonumber(floor)
  end
  return nil
end

-- The rate (starts a second) after `t` us of use since a cut from rate `w`.
local function learned_rate(lim, w, t)
  local x = t / 1000000 - LEARN.K
  local rate = w * (1 + LEARN.C * x * x * x)
  return math.max(1000000 / lim.floor, math.min(1000000 / lim.ceiling, rate))
end

-- Make rate limit `lim` learn: ceiling and floor intervals (us), its record's
-- key; reads the record and sets lim.interval to the learned interval.
local function learns(lim, ceiling, floor, record)
  lim.ceiling, lim.floor, lim.learned = ceiling, math.max(floor, ceiling), record
  local f = redis.call('HMGET', record, 'w', 't', 'ws', 'n', 'cut', 'mark', 'held')
  lim.w = tonumber(f[1]) or 1000000 / ceiling
  lim.t = tonumber(f[2]) or LEARN.K * 1000000
  lim.ws, lim.n, lim.cut = tonumber(f[3]) or now, tonumber(f[4]) or 0, tonumber(f[5]) or 0
  lim.rate = learned_rate(lim, lim.w, lim.t)
  lim.mark, lim.held = tonumber(f[6]) or lim.rate, tonumber(f[7]) or 0
  -- (rounded up: never faster than the ceiling)
  lim.interval = math.ceil(1000000 / lim.rate)
end

local function learn_keep(lim)
  redis.call('PEXPIRE', lim.learned, LEARN.KEEP_MS)
end

-- A start of `units` was charged to learning limit `lim` now: count it; a
-- window that ends and was used moves the rate up.
local function learn_used(lim, units)
  local elapsed = now - lim.ws
  if elapsed < LEARN.WINDOW then
    redis.call('HINCRBY', lim.learned, 'n', units)
    return learn_keep(lim)
  end
  local fields = { 'ws', string.format('%d', now), 'n', '0' }
  local at_ceiling = lim.rate * lim.ceiling >= 1000000
  if not at_ceiling and (lim.n + units) * 1000000 >= LEARN.USED * lim.rate * elapsed then
    local t = lim.t + math.min(elapsed, LEARN.MOST)
    local rate = learned_rate(lim, lim.w, t)
    fields[#fields + 1], fields[#fields + 2] = 't', string.format('%d', t)
    if rate ~= lim.rate then
      for _, v in ipairs({ 'why', 'raise', 'at', string.format('%d', now),
                           'from', string.format('%.6g', lim.rate) }) do
        fields[#fields + 1] = v
      end
      if math.abs(rate - lim.mark) > LEARN.SAY * lim.mark then
        LEARN_MOVES[#LEARN_MOVES + 1] = { lim, lim.mark, rate }
      end
    end
  end
  redis.call('HSET', lim.learned, unpack(fields))
  learn_keep(lim)
end

-- Simply admitted under limits L[1..n] (decide.lua): 1 (a bare integer is
-- cheaper to parse than an array), or, when a learned rate moved far enough
-- to be said, status 1's whole reply with those moves after it, "i before
-- after" each (limit i's rate said last and now), each then marked said.
local function learn_admitted(L, n)
  if #LEARN_MOVES == 0 then
    return 1
  end
  local index, reply = {}, { 1, 0, 0, 0, now, 0, 0, 0 }
  for i = 1, n do
    index[L[i]] = i
  end
  for _, move in ipairs(LEARN_MOVES) do
    if index[move[1]] then
      redis.call('HSET', move[1].learned, 'mark', string.format('%.17g', move[3]))
      reply[#reply + 1] = string.format('%d %.6g %.6g', index[move[1]], move[2], move[3])
    end
  end
  return reply
end

-- A provider refused, for its quota, a request admitted at `sent` (us) under
-- learning limit `lim`: cut, unless it was admitted before the last cut.
-- The time (us) the limit then holds before its next start (0: one interval
-- only; lim.interval is the new one); nil when not cut.
local function learn_cut(lim, sent)
  if sent < lim.cut then
    return nil
  end
  local before = lim.rate
  -- (A hold under way is not made longer: the refusals it meets were sent at once.)
  local hold = (now - lim.cut < LEARN.HOLD and now >= lim.held) and LEARN.HOLD or 0
  lim.w = before
  lim.t, lim.cut = 0, now
  lim.rate = learned_rate(lim, lim.w, 0)
  lim.interval = math.ceil(1000000 / lim.rate)
  local at = string.format('%d', now)
  redis.call('HSET', lim.learned, 'w', string.format('%.17g', lim.w), 't', '0', 'cut', at,
             'ws', at, 'n', '0', 'why', 'cut', 'at', at, 'from', string.format('%.6g', before),
             'mark', string.format('%.17g', lim.rate),
             'held', string.format('%d', hold > 0 and now + hold or lim.held))
  learn_keep(lim)
  return hold
end
