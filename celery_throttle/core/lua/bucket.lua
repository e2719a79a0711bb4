--- @include "core/clock.lua"
--- @include "core/learn.lua"
--[[
celery_throttle bucket.lua: the rate bucket, one copy for every script that
reads or charges one (the gate's commands; room/lua/serve.lua, which
dispatches a waiting task), which include it (core/scripts.py puts it in
front of theirs); the script sets `now` (clock.lua) before it calls any
function below.

GCRA (the leaky bucket as a meter) keeps one integer per bucket: the
theoretical arrival time TAT, in microseconds of the decision clock.  For an
emission interval T, a burst B and a cost c, a start at `now` is allowed when

    max(TAT, now) + c*T - B*T <= now

and then TAT becomes max(TAT, now) + c*T.  Several buckets are decided all or
nothing (decide.lua): either every bucket admits and every bucket is
charged, or none is written.

* A pause (a provider answered 429 with Retry-After): until then the bucket
  admits nothing and honours no start booked before the pause ends.  It is
  stored in the bucket's value, "TAT:until", so a decision still reads one
  key.
* A shift (a settlement charged more than the estimate, or a start later
  than its booked start): the TAT moves on by the difference, and so must every booked start
  booked before, or the tasks holding them would start at the estimates'
  pace (a budget's window far over its bound) or one interval minus the
  lateness after a late start (a window one start over the bound).  The bucket keeps the sum of all such moves,
  "TAT:until:shift" (us); a booking carries the shift it was made at, and
  its claim is honoured that much later: start + (shift now - shift then).
  Refunds move only the TAT (a booked start is never moved earlier).

A rate limit here is a table { key, interval (us), burst, cost }.
]]

local function us(v)
  return string.format('%d', v) -- %d: the default format rounds 16 digits
end

-- A rate bucket's value: "TAT", "TAT:until" while paused, "TAT:until:shift"
-- once a settlement has shifted its bookings (until may then be 0).
local function read_rate(key)
  local raw = redis.call('GET', key)
  if not raw then
    return 0, 0, 0, false
  end
  local tat = tonumber(raw)
  if tat then
    return tat, 0, 0, true
  end
  local t, p, d = string.match(raw, '^(%d+):(%d+):?(%d*)$')
  return tonumber(t), tonumber(p), tonumber(d) or 0, true
end

-- Write a rate bucket; TTL = time until it has drained and any pause is
-- over, so the key never expires while it holds state (a shift matters
-- only to bookings, which an expired bucket voids anyway).
local function write_rate(key, tat, paused, shift)
  local value = us(tat)
  local last = tat
  if paused > now then
    last = math.max(tat, paused)
  end
  if shift > 0 then
    value = value .. ':' .. us(paused > now and paused or 0) .. ':' .. us(shift)
  elseif paused > now then
    value = value .. ':' .. us(paused)
  end
  local ttl_ms = math.ceil((last - now) / 1000)
  if ttl_ms < 1 then
    ttl_ms = 1
  end
  redis.call('SET', key, value, 'PX', ttl_ms)
end

-- THE admission test (GCRA): how long until rate limit `lim` admits its
-- cost, from its TAT (at least now) and pause.  <= 0: admitted now.
local function rate_wait(lim, tat, paused)
  return math.max(tat + (lim.cost - lim.burst) * lim.interval, paused) - now
end

-- The TAT after charging a start at `at`.
local function charged(lim, tat, at)
  return math.max(tat, at) + lim.cost * lim.interval
end

-- Charge rate limit `lim` for a start at `at` (its TAT read as `tat`): the
-- bucket moves on, and a limit that learns counts the use (learn.lua).
local function charge_rate(lim, tat, at, paused, shift)
  write_rate(lim.key, charged(lim, tat, at), paused, shift)
  if lim.learned then
    learn_used(lim, lim.cost)
  end
end
