--- @include "core/clock.lua"
--- @include "core/limits.lua"
--- @include "core/bucket.lua"
--- @include "core/epoch.lua"
--- @include "core/lease.lua"
--[[
celery_throttle decide.lua: may a start happen now under every limit given, and
if not, exactly when?  One atomic decision over rate buckets (bucket.lua)
and concurrency limits (lease.lua), all or nothing.

KEYS and the limits' ARGV: limits.lua.  The command's own:
KEYS[c+i-1] limit i's line of waiting tasks (room/lines.py), i = 1..n, given
          when the decision is in line: while a limit has tasks in its line, a
          fresh start (no claim) is not admitted ahead of them but told to
          join it (status 4); absent otherwise (c: limits.lua's first own key)
ARGV[1]   now (clock.lua)
ARGV[2]   reservation horizon, us; -1 = never reserve.  When denied and the
          wait is <= horizon, the earliest common start S is booked and
          returned, so N waiting jobs get N distinct, evenly spaced starts
          instead of returning all at once.  A limit is booked at S only if it
          would otherwise be free for at most one start of its own before S
          (the limits that force S always are): GCRA keeps one TAT per bucket
          and cannot hold a hole, so booking a limit free long before S would
          block its other users until S.  The others are charged at the claim.
ARGV[3]   claim: the booked start S (us) this caller booked earlier, or 0
ARGV[4]   claim grace, us: a claim is honoured from S up to S + grace; later
          it is void and a fresh decision is made (a late start in an old booked start
          would crowd a newer window and break the bound).  A start later than
          S moves the later booked starts of its booked limits by as much (the shift,
          bucket.lua).  A claim up to the grace before S, booked in every
          limit, is admitted for S itself (status 1 with wait_us: start then,
          without asking again)
ARGV[5]   claim mask: bit i-1 set where the claimed start is booked in limit i;
          the other limits are charged when the claim is honoured; 0 without
ARGV[6]   claim epoch: the epoch the claimed start was booked in (epoch.lua); 0
          without.  A claim is also void if a booked bucket no longer holds
          the booked start (TAT < S + c*T: the key was evicted or reset)
ARGV[7]   holder: the lease owner's id (a task id) when a concurrency limit
          takes part, else ""
ARGV[8]   near, us: a start booked at most this far ahead in every limit is
          admitted for itself (status 1 with wait_us: the caller sleeps and
          starts without claiming, one call per start); 0 = always claim
ARGV[9]   claim shift: the sum of the booked limits' shifts when the claimed
          start was booked (the reply's `shift`); 0 without

Reply: 1 when simply allowed (charged now; or learn.lua's learn_admitted); otherwise
       { status, wait_us, blocking, start_us, now_us, mask, epoch, shift } (integers only)
  status   1 allowed (charged now, or a claim honoured: at once, or after
           wait_us when admitted for its booked start ahead of it; or a start booked
           within `near`, after wait_us), 0 denied (nothing written), 2
           reserved (start booked, start at start_us; with mask 0, nothing
           booked: a full concurrency limit's paced return time), 3 early (a
           claim for a booked start still ahead, or one whose unbooked limits free up
           within the grace and are now booked too: claim again after
           wait_us), 4 queued (in line: limit `blocking` has waiting tasks;
           nothing written; wait_us estimates the wait behind them)
  wait_us  microseconds until the start may happen (0 when allowed)
  blocking the 1-based index of the limit that forced the longest wait, or 0
  start_us  the booked or claimed start, or 0
  now_us   the clock this decision used
  mask     with status 2, the limits the start is booked in (bit i-1 = limit i)
  epoch    with status 2 or 3, the epoch of the booking
  shift    with status 1, 2 or 3, the sum of the booked limits' shifts at the
           booking (hand it back as ARGV[9] with the claim)
]]

now = clock_of(ARGV[1]) -- (declared by clock.lua)
local horizon = tonumber(ARGV[2])
local claim = tonumber(ARGV[3])
local grace = tonumber(ARGV[4])
local mask = tonumber(ARGV[5])
local claim_epoch = tonumber(ARGV[6])
local holder = ARGV[7]
local near = tonumber(ARGV[8])
local claim_shift = tonumber(ARGV[9])
local L, n, m, own = limits_of(9)
local epoch_key = KEYS[n + 1]
local in_line = #KEYS >= own
if in_line then
  for i = 1, n do
    L[i].line = KEYS[own + i - 1]
  end
end
-- A waiter's return is paced by the expected run: at least this long.
local MIN_RUN, UNKNOWN_RUN = 50000, 1000000

-- The hot path: a plain decision (no claim, rate limits only) that admits.
-- Read and test every bucket, charge them all, reply 1, before the rest of
-- the script's functions are even defined (Lua makes each one anew per
-- call).  Anything else (a wait, a claim, a lease) falls through to the
-- full decision below, which reads the buckets again.
if claim == 0 and m == 0 then
  local tats, pauses, shifts = {}, {}, {}
  for i = 1, n do
    local tat, paused, shift = read_rate(L[i].key)
    tat = math.max(tat, now)
    if rate_wait(L[i], tat, paused) > 0
        or (in_line and redis.call('EXISTS', L[i].line) == 1) then
      tats = nil
      break
    end
    tats[i], pauses[i], shifts[i] = tat, paused, shift
  end
  if tats then
    for i = 1, n do
      charge_rate(L[i], tats[i], now, pauses[i], shifts[i])
    end
    return learn_admitted(L, n)
  end
end

-- How far apart waiters come back: the expected run / seats.  The expected
-- run is the average of released runs (at least MIN_RUN).  Before any run
-- has ended it is how long the oldest holder has been running, at least
-- MIN_RUN and at most UNKNOWN_RUN: a short guess would bring waiters back
-- too often, a long one would leave a freed seat idle (and a killed
-- holder's seat idle past its lease).  Waiters share one cursor ('next'),
-- so whatever the estimate, returns happen one step apart, never at once.
local function step_of(lim)
  local run = meta_num(lim, 'run')
  if run == 0 then
    for _, h in ipairs(redis.call('ZRANGE', lim.key, 0, -1)) do
      local since = tonumber(redis.call('HGET', lim.meta, 's:' .. h) or now)
      run = math.max(run, now - since)
    end
    run = math.min(run, UNKNOWN_RUN)
  end
  return math.ceil(math.max(run, MIN_RUN) / lim.seats)
end

-- The decision.
-- Read every limit once; wait[i] = how long until limit i admits its cost
-- (a full concurrency limit: until its paced return).
local tats, stored, paused, shifts, waits, steps = {}, {}, {}, {}, {}, {}
local wait, blocking = 0, 0
for i = 1, n do
  local lim = L[i]
  if lim.concurrent then
    reclaim(lim)
    paused[i] = meta_num(lim, 'pause')
    waits[i] = paused[i] - now
    if not redis.call('ZSCORE', lim.key, holder)
        and redis.call('ZCARD', lim.key) >= lim.seats then
      steps[i] = step_of(lim) -- full: this waiter's turn on the shared cursor
      local back = math.max(meta_num(lim, 'next'), now + steps[i])
      waits[i] = math.max(waits[i], back - now)
    end
  else
    local tat
    tat, paused[i], shifts[i] = read_rate(lim.key)
    stored[i] = tat
    tats[i] = math.max(tat, now)
    waits[i] = rate_wait(lim, tats[i], paused[i])
  end
  if waits[i] > wait then
    wait, blocking = waits[i], i
  end
end

-- In line: a fresh start does not pass tasks waiting in a limit's line.
-- It joins the longest wait among them (estimated: the limit's own wait,
-- then one start per task ahead).
if in_line and claim == 0 then
  local behind, at = 0, 0
  for i = 1, n do
    local lim = L[i]
    local ahead = redis.call('ZCARD', lim.line)
    if lim.concurrent and redis.call('ZSCORE', lim.key, holder) then
      ahead = 0 -- its seat is taken already (its turn came in that line)
    end
    if ahead > 0 then
      -- (a seat: one expected run per seat for each task ahead)
      local est = math.max(waits[i], 0)
                  + ahead * (lim.concurrent and step_of(lim) or lim.cost * lim.interval)
      if est > behind then
        behind, at = est, i
      end
    end
  end
  if at > 0 then
    return { 4, behind, at, 0, now, 0, 0, 0 }
  end
end

-- Charge limit i for a start at `at`: a rate bucket's TAT moves on; a
-- concurrency limit gets this holder's lease.
local function charge(i, at)
  local lim = L[i]
  if lim.concurrent then
    take(lim, holder, now)
    return
  end
  charge_rate(lim, tats[i], at, paused[i], shifts[i])
end

-- Only reservations and claims need the epoch: the hot path never reads it.
local function epoch()
  return tonumber(epoch_of(epoch_key, now))
end

local function claim_valid()
  if claim_epoch ~= epoch() then
    return false
  end
  for i = 1, n do
    local lim = L[i]
    if booked_in(mask, i) then
      if lim.concurrent then
        if not redis.call('ZSCORE', lim.key, holder) then
          return false
        end
      elseif stored[i] < claim + lim.cost * lim.interval or paused[i] > claim then
        return false -- the key was evicted or reset, or a pause came after the booking
      end
    end
  end
  return true
end

-- The sum of limit shifts over the limits in mask mk (0 for concurrency limits).
local function shift_of(mk)
  local sum = 0
  for i = 1, n do
    if booked_in(mk, i) and not L[i].concurrent then
      sum = sum + shifts[i]
    end
  end
  return sum
end

-- A start later than its booked start moves the starts booked after it in the limits
-- it is booked in by as much (the same shift a settlement makes), so the
-- next start keeps the full interval from this one: the window bound holds
-- on the starts themselves, not only on the booked starts.
local function push_back(mk, by)
  if by <= 0 then
    return
  end
  for i = 1, n do
    local lim = L[i]
    if booked_in(mk, i) and not lim.concurrent then
      shifts[i] = shifts[i] + by
      stored[i] = math.max(stored[i] + by, now + lim.cost * lim.interval)
      write_rate(lim.key, stored[i], paused[i], shifts[i])
    end
  end
end

local function all_booked(mk)
  for i = 1, n do
    if L[i].concurrent or not booked_in(mk, i) then
      return false
    end
  end
  return true
end

if claim > 0 and claim_valid() then
  -- Settlements and late starts since the booking moved the booked start this much.
  local due = claim + math.max(0, shift_of(mask) - claim_shift)
  if now < due then
    if all_booked(mask) and due - now <= grace then
      -- Admitted for `due` itself: the caller sleeps the rest and starts
      -- without asking again (another round trip would arrive late).
      return { 1, due - now, 0, claim, now, mask, claim_epoch, claim_shift }
    end
    return { 3, due - now, 0, claim, now, mask, claim_epoch, claim_shift }
  end
  if now <= due + grace then
    -- The booked limits were charged at booking; the others must admit now.
    local busy, stuck = 0, false
    for i = 1, n do
      if not booked_in(mask, i) and waits[i] > 0 then
        busy = math.max(busy, waits[i])
        stuck = stuck or L[i].concurrent == true -- a lease cannot be booked ahead
      end
    end
    if busy == 0 then
      for i = 1, n do
        if not booked_in(mask, i) then
          charge(i, now)
        end
      end
      push_back(mask, now - due)
      return { 1, 0, 0, claim, now, mask, claim_epoch, claim_shift }
    end
    if not stuck and now + busy <= due + grace then
      -- An unbooked limit frees up within the grace (a shared limit another
      -- task just took): book it there and answer "early", so the caller
      -- sleeps that long and claims again, rather than losing a booked start of
      -- every booked limit for a wait shorter than the grace.  The booked start is
      -- now that moment, and the limits booked before move back to it.
      local start = now + busy
      push_back(mask, start - due)
      local more = mask
      for i = 1, n do
        if not booked_in(mask, i) then
          charge(i, start)
          more = more + 2 ^ (i - 1)
        end
      end
      return { 3, busy, 0, start, now, more, claim_epoch, shift_of(more) }
    end
  end
  -- Late, or an unbooked limit is busy: the old booked start is lost, decide afresh.
end
-- (A void claim, from an older epoch or a bucket that lost it, decides afresh too.)

if wait <= 0 then
  for i = 1, n do
    charge(i, now)
  end
  return learn_admitted(L, n)
end
local waiting_on_lease = false
for i = 1, n do
  local lim = L[i]
  if lim.concurrent and waits[i] > 0 then
    waiting_on_lease = true
    if steps[i] then -- full: the next waiter comes back one step after this one
      redis.call('HSET', lim.meta, 'next', us(now + waits[i] + steps[i]))
      keep_at_least(lim.meta, META_TTL_MS)
    end
  end
end
if waiting_on_lease then
  -- Nothing is booked: rate starts held for a task that may not get its
  -- lease then would be lost.  It comes back at its paced time and asks.
  if horizon < 0 then
    return { 0, wait, blocking, 0, now, 0, 0, 0 }
  end
  return { 2, wait, blocking, now + wait, now, 0, epoch(), 0 }
end
if horizon >= 0 and wait <= horizon then
  local booked = 0
  for i = 1, n do
    local lim = L[i] -- a free concurrency limit is not booked: its lease is taken at the claim
    if not lim.concurrent and wait - math.max(waits[i], 0) <= lim.cost * lim.interval then
      charge(i, now + wait)
      booked = booked + 2 ^ (i - 1)
    end
  end
  -- Near, booked in every limit: admitted for the booked start itself.  A pause or
  -- a settlement written before it no longer reaches this start, as it
  -- would not reach a request already sent; the caller's `near` bounds that.
  local status = (wait <= near and all_booked(booked)) and 1 or 2
  return { status, wait, blocking, now + wait, now, booked, epoch(), shift_of(booked) }
end
return { 0, wait, blocking, 0, now, 0, 0, 0 }
