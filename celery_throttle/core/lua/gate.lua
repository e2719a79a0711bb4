--- @include "core/bucket.lua"
--- @include "core/epoch.lua"
--- @include "core/lease.lua"
--[[
celery_throttle gate: one atomic decision over one or more GCRA buckets.

GCRA (the leaky bucket as a meter) keeps one integer per bucket: the
theoretical arrival time TAT, in microseconds of the decision clock.  For an
emission interval T, a burst B and a cost c, a start at `now` is allowed when

    max(TAT, now) + c*T - B*T <= now

and then TAT becomes max(TAT, now) + c*T.  Several buckets are decided all or
nothing: either every bucket admits and every bucket is charged, or none is
written.  The bucket itself (its stored value, the admission test and the charge)
is bucket.lua, which this script includes: the waiting
room's dispatch (room/lua/serve.lua) charges through the same functions.

Two more kinds of state share the script:

* A concurrency limit (interval 0 below) is a sorted set of leases: member
  = the holder (a task id), score = when the lease expires.  Expired leases
  are reclaimed here, before counting, so a killed worker's slot comes back
  within one lease time; a running task's heartbeat extends its lease.  A
  full concurrency limit cannot book a future slot (nobody knows when a
  lease ends), so waiters are paced instead: the k-th waiter is told to come
  back k x (expected run / slots) from now, a GCRA over returns, rather than
  all at once (no herd).  Its hash (the "meta" key) keeps the average run,
  each holder's start ("s:<holder>"), the pacing cursor and a pause.
* A pause (a provider answered 429 with Retry-After): until then the limit
  admits nothing and honours no slot booked before the pause ends.  A rate
  bucket stores it in its value, "TAT:until", so the hot path still reads one
  key; a concurrency limit stores it in its meta hash.
* A shift (a settlement charged more than the estimate, or a start later
  than its slot): the TAT moves on by the difference, and so must every slot
  booked before, or the tasks holding them would start at the estimates'
  pace (measured: 345 tokens in a 2 s window of a 90/s, burst 80 budget) or
  one interval minus the lateness after a late start (a window one start
  over the bound).  The bucket keeps the sum of all such moves,
  "TAT:until:shift" (us); a booking carries the shift it was made at, and
  its claim is honoured that much later: slot + (shift now - shift then).
  Refunds move only the TAT (a slot is never moved earlier).

KEYS[i]   the bucket of limit i, i = 1..n (all share one hash tag; see keys.py)
KEYS[n+1] the prefix's epoch (epoch.lua): set once (no TTL) when first needed.  A
          reservation carries it; a Redis restart or flush loses it, and a new
          one voids every older booking, which the emptied buckets no longer
          count (honouring them next to fresh starts would double the rate).
KEYS[n+1+j] the meta hash of the j-th concurrency limit among the n
With op "release" only (m = the number of concurrency limits):
KEYS[n+1+m+j] the j-th concurrency limit's queue of tasks waiting in line
          for a seat (room/queues.py): due at once when a seat is given back
KEYS[n+2+2m] the limits' queues' ready index (room/queues.py)
KEYS[n+3+2m] the dispatchers' wake list (room/parking.py): one token
With op "q" only:
KEYS[n+1+m+i] limit i's queue of waiting tasks (room/queues.py), i = 1..n: a
          rate limit's, or a concurrency limit's queue for a seat
With op "follow" and "inspect" (rate limits only):
KEYS[n+1+i] limit i's hold note (keys.py "h"): why a provider's report holds
          it back, "remaining reset_us reported_us", expiring at the reset

ARGV[1]   now, microseconds; 0 = use this server's TIME
ARGV[2]   reservation horizon, microseconds; -1 = never reserve.
          When denied and the wait is <= horizon, the earliest common slot S is
          booked and returned, so N waiting jobs get N distinct, evenly spaced
          start times instead of returning all at once.  A limit is booked at
          S only if it would otherwise be free for at most one start of its
          own before S (the limits that force S always are): GCRA keeps one
          TAT per bucket and cannot hold a hole, so booking a limit free long
          before S would block its other users until S.  The others are
          charged when the slot is claimed.
ARGV[3]   claim: the slot S (microseconds) this caller booked earlier, or 0
ARGV[4]   claim grace, microseconds: a claim is honoured from S up to S + grace;
          later it is void and a fresh decision is made (a late start in an
          old slot would crowd a newer window and break the bound).  A start
          later than S moves the later slots of its booked limits by as much
          (the shift, below).  A claim up to the grace before S, booked in
          every limit, is admitted for S itself (status 1 with wait_us: start
          then, without asking again)
ARGV[5]   claim mask: bit i-1 set where the claimed slot is booked in limit i;
          the other limits are charged when the claim is honoured; 0 without
ARGV[6]   claim epoch: the epoch the claimed slot was booked in; 0 without.
          A claim is also void if a booked bucket no longer holds the slot
          (TAT < S + c*T: the key was evicted or reset).
ARGV[7]   holder: the lease owner's id (a task id) when a concurrency limit
          takes part, else ""
ARGV[8]   op: "a" decide (the reply below); "q" decide in line: while a
          limit has tasks in its queue, a fresh start (no claim) is not
          admitted ahead of them but told to join the queue (status 4);
          "release", "extend", "pause",
          "resume" (a pause ends now), "settle", "follow" (a provider's
          report of what is left: the cost field carries the units
          remaining, op_arg the us until its limit is full), "cancel" (a booking given
          back: the claim fields name it), "inspect" (one function each, near
          the end of the script)
ARGV[9]   op argument (microseconds): release: how long the holder ran;
          pause: for how long; follow: until the provider's reset; a
          decision ("a", "q"): near, a slot booked at most this far ahead in
          every limit is admitted for itself (status 1 with wait_us: the
          caller sleeps and starts without claiming, one call per start;
          0 = always claim); otherwise 0.  release, extend, pause, resume,
          settle and follow reply with a count: leases released, leases
          lost (extend), limits that were paused (resume), limits settled or
          moved (follow), or for pause the longest pause now in force (us);
          cancel: the limits whose booking was given back.
          inspect reads its one limit without writing anything and replies
            a rate limit:  { exists, tat_ahead_us, next_free_us, pttl_ms, now, paused_us,
                             held_us, held_remaining (-1: not held), held_at_us }
            a concurrency limit: { held, paused_us, average_run_us, now }
          (next_free_us by the same test as a decision: one copy of it)
ARGV[10]  claim shift: the sum of the booked limits' shifts when the claimed
          slot was booked (the reply's `shift`); 0 without
ARGV[8+3i .. 10+3i] for limit i = 1..n (ARGV[11], ARGV[12], ARGV[13] for i = 1):
          a rate limit: interval T (microseconds >= 1), burst B (>= 1), cost c
          (1 <= c <= B; checked by the caller); for "settle", c is the
          correction in units (actual - charged, may be negative); for
          "follow", the units the provider says remain (>= 0).
          A concurrency limit: 0, slots N (>= 1), lease (microseconds >= 1).

Reply: 1 when simply allowed (charged now); otherwise
       { status, wait_us, blocking, slot_us, now_us, mask, epoch, shift } (integers only)
  status   1 allowed (charged now, or a claim honoured: at once, or after
           wait_us when admitted for its slot ahead of it; or a slot booked
           within `near`, after wait_us), 0 denied (nothing
           written), 2 reserved (slot booked, start at slot_us; with mask 0,
           nothing booked: a full concurrency limit's paced return time), 3 early (a
           claim for a slot still ahead, or one whose unbooked limits free up
           within the grace and are now booked too: claim again after wait_us),
           4 queued (op "q": limit `blocking` has waiting tasks; nothing
           written; wait_us estimates the wait behind them)
  wait_us  microseconds until the start may happen (0 when allowed)
  blocking the 1-based index of the limit that forced the longest wait, or 0
  slot_us  the booked or claimed slot, or 0
  now_us   the clock this decision used
  mask     with status 2, the limits the slot is booked in (bit i-1 = limit i)
  epoch    with status 2 or 3, the epoch of the booking
  shift    with status 1, 2 or 3, the sum of the booked limits' shifts at the
           booking (hand it back as ARGV[10] with the claim)
]]

now = tonumber(ARGV[1]) -- declared by bucket.lua, which comes first
if now <= 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local horizon = tonumber(ARGV[2])
local claim = tonumber(ARGV[3])
local grace = tonumber(ARGV[4])
local mask = tonumber(ARGV[5])
local claim_epoch = tonumber(ARGV[6])
local holder = ARGV[7]
local op = ARGV[8]
local op_arg = tonumber(ARGV[9])
local claim_shift = tonumber(ARGV[10])
local HEAD = 10
local n = (#ARGV - HEAD) / 3
local epoch_key = KEYS[n + 1]
-- A waiter's return is paced by the expected run: at least this long.
local MIN_RUN, UNKNOWN_RUN = 50000, 1000000

local function booked_in(m, i)
  return math.floor(m / 2 ^ (i - 1)) % 2 == 1
end

-- The limits, read once.  A rate limit: { key, interval, burst, cost }; a
-- concurrency limit (interval 0 in ARGV): { key, concurrent, slots, lease,
-- meta, line }, line (its queue) only with op "release".
local L = {}
local m = 0 -- concurrency limits among the n
for i = 1, n do
  local base = HEAD + 3 * i
  local interval = tonumber(ARGV[base - 2])
  if interval == 0 then
    m = m + 1
    L[i] = { key = KEYS[i], concurrent = true, slots = tonumber(ARGV[base - 1]),
             lease = tonumber(ARGV[base]), meta = KEYS[n + 1 + m], nth = m }
  else
    L[i] = { key = KEYS[i], interval = interval, burst = tonumber(ARGV[base - 1]),
             cost = tonumber(ARGV[base]) }
  end
end
if op == 'release' then
  for i = 1, n do
    if L[i].concurrent then
      L[i].line = KEYS[n + 1 + m + L[i].nth]
    end
  end
end

-- ---------------------------------------------------------------------------
-- Rate buckets.

-- The hot path: a plain decision (no claim, rate limits only) that admits.
-- Read and test every bucket, charge them all, reply 1, before the rest of
-- the script's functions are even defined (Lua makes each one anew per
-- call).  Anything else (a wait, a claim, a lease) falls through to the
-- full decision below, which reads the buckets again.
local in_line = op == 'q'
if in_line then
  for i = 1, n do
    L[i].queue = KEYS[n + 1 + m + i]
  end
end
if (op == 'a' or in_line) and claim == 0 and m == 0 then
  local tats, pauses, shifts = {}, {}, {}
  for i = 1, n do
    local tat, paused, shift = read_rate(L[i].key)
    tat = math.max(tat, now)
    if rate_wait(L[i], tat, paused) > 0
        or (in_line and redis.call('EXISTS', L[i].queue) == 1) then
      tats = nil
      break
    end
    tats[i], pauses[i], shifts[i] = tat, paused, shift
  end
  if tats then
    for i = 1, n do
      write_rate(L[i].key, charged(L[i], tats[i], now), pauses[i], shifts[i])
    end
    return 1
  end
end

-- ---------------------------------------------------------------------------
-- Concurrency limits.

-- (keep_at_least, meta_num, reclaim and take: lease.lua.)

-- How far apart waiters come back: the expected run / slots.  The expected
-- run is the average of released runs (at least MIN_RUN).  Before any run
-- has ended it is how long the oldest holder has been running, at least
-- MIN_RUN and at most UNKNOWN_RUN: a short guess would bring waiters back
-- too often, a long one would leave a freed seat idle (and a killed
-- holder's slot idle past its lease).  Waiters share one cursor ('next'),
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
  return math.ceil(math.max(run, MIN_RUN) / lim.slots)
end

-- Wake a dispatcher: one token is enough (as park.lua).
local function wake_up(wake)
  redis.call('LPUSH', wake, '1')
  redis.call('LTRIM', wake, 0, 0)
  redis.call('PEXPIRE', wake, 60000)
end

-- A seat given back: the tasks waiting in line for one are due now (the
-- dispatcher serves the queue, room/lua/serve.lua), not when the earliest
-- lease would have expired.
local function line_due(lim)
  if redis.call('EXISTS', lim.line) == 0 then
    return
  end
  local ready, wake = KEYS[n + 2 + 2 * m], KEYS[n + 3 + 2 * m]
  local current = tonumber(redis.call('ZSCORE', ready, lim.line))
  if not current or current > now then
    redis.call('ZADD', ready, now, lim.line)
    wake_up(wake)
  end
end

-- ---------------------------------------------------------------------------
-- The operations besides the decision: one function each.

-- Give back holder's leases; feed the average run; ring the seat's line.
local function release()
  local count = 0
  for i = 1, n do
    local lim = L[i]
    if lim.concurrent then
      local since = tonumber(redis.call('HGET', lim.meta, 's:' .. holder) or 0)
      redis.call('HDEL', lim.meta, 's:' .. holder)
      if redis.call('ZREM', lim.key, holder) == 1 then
        count = count + 1
        local ran = op_arg -- the holder's own measure, else the server's
        if ran <= 0 and since > 0 then
          ran = now - since
        end
        if ran > 0 then -- average run: moves a quarter of the way per run
          local avg = meta_num(lim, 'run')
          if avg > 0 then
            avg = math.floor((3 * avg + ran) / 4)
          else
            avg = ran
          end
          redis.call('HSET', lim.meta, 'run', us(avg))
          redis.call('PEXPIRE', lim.meta, META_TTL_MS)
        end
      end
      if lim.line then
        line_due(lim)
      end
    end
  end
  return count
end

-- Keep holder's leases; one that expired and was reclaimed is taken again
-- if a seat is free.  Counts the leases lost (all seats taken by others).
local function extend()
  local count = 0
  for i = 1, n do
    local lim = L[i]
    if lim.concurrent then
      reclaim(lim)
      if redis.call('ZSCORE', lim.key, holder)
          or redis.call('ZCARD', lim.key) < lim.slots then
        take(lim, holder, now)
      else
        count = count + 1
      end
    end
  end
  return count
end

-- Admit nothing for op_arg us; returns the longest pause now in force (us).
local function pause()
  local longest = 0
  for i = 1, n do
    local lim = L[i]
    local till = now + op_arg
    if lim.concurrent then
      till = math.max(meta_num(lim, 'pause'), till)
      redis.call('HSET', lim.meta, 'pause', us(till))
      keep_at_least(lim.meta, math.ceil((till - now) / 1000))
    else
      local tat, paused, shift = read_rate(lim.key)
      till = math.max(paused, till)
      write_rate(lim.key, math.max(tat, now), till, shift)
    end
    longest = math.max(longest, till - now)
  end
  return longest
end

-- End a pause now (an operator's `celery throttle resume`); returns the
-- limits that were paused.
local function resume()
  local count = 0
  for i = 1, n do
    local lim = L[i]
    if lim.concurrent then
      if meta_num(lim, 'pause') > now then
        count = count + 1
      end
      redis.call('HDEL', lim.meta, 'pause')
    else
      local tat, paused, shift = read_rate(lim.key)
      if paused > now then
        count = count + 1
        write_rate(lim.key, math.max(tat, now), 0, shift)
      end
    end
  end
  return count
end

-- The charge was an estimate: move the TAT by the difference (the cost
-- field carries it).  A charge also shifts the slots booked before it (see
-- the top).  A refund never makes the bucket fuller than full, and is given
-- only while no slot is booked past the burst: with slots booked ahead, a
-- lower TAT would hand their times out a second time.
local function settle()
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
end

-- The provider reported `remaining` units (the cost field) left until its
-- limit is full again, op_arg us from now: its own count, which callers the
-- gate cannot see spend too.  Spend at most that many before then, the
-- slots booked here included (the provider has not seen them): the TAT
-- moves to where unit remaining + 1 is admitted at the reset at the
-- earliest, plus the booked units.  Booked are the units past a full
-- burst (starts never go past it; bookings do), rounded up.  The move is a
-- settlement's charge (booked slots shift with it, keeping their order
-- before the new ones); a bucket already that strict is left alone.
-- Returns the limits moved.
local function follow()
  local count = 0
  for i = 1, n do
    local lim = L[i]
    if not lim.concurrent then
      local tat, paused, shift = read_rate(lim.key)
      local base = math.max(tat, now)
      local booked = math.max(0, tat - now - lim.burst * lim.interval)
      booked = math.ceil(booked / lim.interval) * lim.interval
      local target = now + op_arg - (lim.cost + 1 - lim.burst) * lim.interval + booked
      if target > base then
        write_rate(lim.key, target, paused, shift + target - base)
        count = count + 1
        -- Why, for `status`: gone when the provider's window resets.
        redis.call('SET', KEYS[n + 1 + i], lim.cost .. ' ' .. us(now + op_arg) .. ' '
                   .. us(now), 'PX', math.max(1, math.ceil(op_arg / 1000)))
      end
    end
  end
  return count
end

-- Give back a booking its holder will not use (a waiter cancelled before its
-- slot): the claim fields name it.  Only the last booking of a bucket can be
-- given back, its TAT moved back to the slot; a bucket that moved on since
-- (any later booking, charge or shift) keeps it: a hole costs throughput, a
-- slot handed out twice would break the bound.  Returns the limits given back.
local function cancel()
  local count = 0
  if claim <= 0 or claim_epoch ~= tonumber(redis.call('GET', epoch_key) or 0) then
    return 0
  end
  for i = 1, n do
    local lim = L[i]
    if not lim.concurrent and booked_in(mask, i) then
      local tat, paused, shift = read_rate(lim.key)
      if tat == claim + lim.cost * lim.interval and tat > now then
        write_rate(lim.key, math.max(claim, now), paused, shift)
        count = count + 1
      end
    end
  end
  return count
end

-- Read the one limit given, writing nothing (status commands, metrics).
local function inspect()
  local lim = L[1]
  if lim.concurrent then
    local held = redis.call('ZCOUNT', lim.key, '(' .. us(now), '+inf')
    local paused = math.max(0, meta_num(lim, 'pause') - now)
    return { held, paused, meta_num(lim, 'run'), now }
  end
  local tat, paused, _, exists = read_rate(lim.key)
  tat = math.max(tat, now)
  local left, reset, at = -1, now, 0
  local note = KEYS[n + 2] and redis.call('GET', KEYS[n + 2])
  if note then
    local a, b, c = string.match(note, '^(%d+) (%d+) (%d+)$')
    if a and tonumber(b) > now then
      left, reset, at = tonumber(a), tonumber(b), tonumber(c)
    end
  end
  return { exists and 1 or 0, tat - now, math.max(0, rate_wait(lim, tat, paused)),
           redis.call('PTTL', lim.key), now, math.max(0, paused - now), reset - now, left, at }
end

-- ---------------------------------------------------------------------------
-- The decision.

local function decide()
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
          and redis.call('ZCARD', lim.key) >= lim.slots then
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

  -- In line: a fresh start does not pass tasks waiting in a limit's queue.
  -- It joins the longest wait among them (estimated: the limit's own wait,
  -- then one start per task ahead).
  if in_line and claim == 0 then
    local behind, at = 0, 0
    for i = 1, n do
      local lim = L[i]
      local ahead = redis.call('ZCARD', lim.queue)
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
    write_rate(lim.key, charged(lim, tats[i], at), paused[i], shifts[i])
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

  -- A start later than its slot moves the slots booked after it in the limits
  -- it is booked in by as much (the same shift a settlement makes), so the
  -- next start keeps the full interval from this one: the window bound holds
  -- on the starts themselves, not only on the slots.
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
    -- Settlements and late starts since the booking moved the slot this much.
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
        -- sleeps that long and claims again, rather than losing a slot of
        -- every booked limit for a wait shorter than the grace.  The slot is
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
    -- Late, or an unbooked limit is busy: the old slot is lost, decide afresh.
  end
  -- (A void claim, from an older epoch or a bucket that lost it, decides afresh too.)

  if wait <= 0 then
    for i = 1, n do
      charge(i, now)
    end
    return 1 -- the hot path: a bare integer is cheaper to parse than an array
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
    -- Nothing is booked: rate slots held for a task that may not get its
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
    -- Near, booked in every limit: admitted for the slot itself.  A pause or
    -- a settlement written before it no longer reaches this start, as it
    -- would not reach a request already sent; the caller's `near` bounds that.
    local status = (wait <= op_arg and all_booked(booked)) and 1 or 2
    return { status, wait, blocking, now + wait, now, booked, epoch(), shift_of(booked) }
  end
  return { 0, wait, blocking, 0, now, 0, 0, 0 }
end

-- ---------------------------------------------------------------------------
-- Dispatch: once, here.
local OPS = { a = decide, q = decide, release = release, extend = extend, pause = pause,
              resume = resume, settle = settle, follow = follow, cancel = cancel,
              inspect = inspect }
local run = OPS[op]
if not run then
  return redis.error_reply('celery_throttle gate.lua: unknown op ' .. tostring(op))
end
return run()
