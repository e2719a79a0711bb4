--[[
celery_throttle gate: one atomic decision over one or more GCRA buckets.

GCRA (the leaky bucket as a meter) keeps one integer per bucket: the
theoretical arrival time TAT, in microseconds of the decision clock.  For an
emission interval T, a burst B and a cost c, a start at `now` is allowed when

    max(TAT, now) + c*T - B*T <= now

and then TAT becomes max(TAT, now) + c*T.  Several buckets are decided all or
nothing: either every bucket admits and every bucket is charged, or none is
written.  This script is the only copy of the algorithm.

KEYS[i]   the bucket of limit i, i = 1..n (all share one hash tag; see keys.py)
KEYS[n+1] the prefix's epoch: set once (no TTL) when first needed.  A
          reservation carries it; a Redis restart or flush loses it, and a new
          one voids every older booking, which the emptied buckets no longer
          count (honouring them next to fresh starts would double the rate).

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
          old slot would crowd a newer window and break the bound)
ARGV[5]   claim mask: bit i-1 set where the claimed slot is booked in limit i;
          the other limits are charged when the claim is honoured; 0 without
ARGV[6]   claim epoch: the epoch the claimed slot was booked in; 0 without.
          A claim is also void if a booked bucket no longer holds the slot
          (TAT < S + c*T: the key was evicted or reset).
ARGV[4+3i .. 6+3i] for limit i = 1..n (ARGV[7], ARGV[8], ARGV[9] for i = 1):
          interval T (microseconds >= 1), burst B (>= 1), cost c (1 <= c <= B;
          checked by the caller)

Reply: 1 when simply allowed (charged now); otherwise
       { status, wait_us, blocking, slot_us, now_us, mask, epoch } (integers only)
  status   1 allowed (charged now, or a claim honoured), 0 denied (nothing
           written), 2 reserved (slot booked, start at slot_us), 3 early (a
           claim for a slot still ahead, or one whose unbooked limits free up
           within the grace and are now booked too: claim again after wait_us)
  wait_us  microseconds until the start may happen (0 when allowed)
  blocking the 1-based index of the limit that forced the longest wait, or 0
  slot_us  the booked or claimed slot, or 0
  now_us   the clock this decision used
  mask     with status 2, the limits the slot is booked in (bit i-1 = limit i)
  epoch    with status 2 or 3, the epoch of the booking
]]

local now = tonumber(ARGV[1])
if now <= 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local horizon = tonumber(ARGV[2])
local claim = tonumber(ARGV[3])
local grace = tonumber(ARGV[4])
local mask = tonumber(ARGV[5])
local claim_epoch = tonumber(ARGV[6])
local n = #KEYS - 1
local epoch_key = KEYS[n + 1]

local function booked_in(m, i)
  return math.floor(m / 2 ^ (i - 1)) % 2 == 1
end

local function limit(i)
  local base = 6 + 3 * i
  return tonumber(ARGV[base - 2]), tonumber(ARGV[base - 1]), tonumber(ARGV[base])
end

-- Read every bucket once; wait[i] = how long until limit i admits its cost.
local tats, stored, waits = {}, {}, {}
local wait, blocking = 0, 0
for i = 1, n do
  local interval, burst, cost = limit(i)
  local tat = tonumber(redis.call('GET', KEYS[i]) or 0)
  stored[i] = tat
  if tat < now then
    tat = now
  end
  tats[i] = tat
  waits[i] = tat + (cost - burst) * interval - now
  if waits[i] > wait then
    wait, blocking = waits[i], i
  end
end

-- Charge limit i for a start at `at`: write, then TTL = time until the
-- bucket has drained (TAT reached), so the key never expires while it holds
-- state, and idle buckets vanish on their own.
local function charge(i, at)
  local interval, _, cost = limit(i)
  local tat = tats[i]
  if tat < at then
    tat = at
  end
  tat = tat + cost * interval
  local ttl_ms = math.ceil((tat - now) / 1000)
  if ttl_ms < 1 then
    ttl_ms = 1
  end
  -- %d: Lua's default number formatting would round a 16-digit TAT.
  redis.call('SET', KEYS[i], string.format('%d', tat), 'PX', ttl_ms)
end

-- Only reservations and claims need the epoch: the hot path never reads it.
local function epoch()
  local e = tonumber(redis.call('GET', epoch_key) or 0)
  if e == 0 then
    e = now
    redis.call('SET', epoch_key, string.format('%d', e))
  end
  return e
end

local function claim_valid()
  if claim_epoch ~= epoch() then
    return false
  end
  for i = 1, n do
    local interval, _, cost = limit(i)
    if booked_in(mask, i) and stored[i] < claim + cost * interval then
      return false
    end
  end
  return true
end

if claim > 0 and claim_valid() then
  if now < claim then
    return { 3, claim - now, 0, claim, now, mask, claim_epoch }
  end
  if now <= claim + grace then
    -- The booked limits were charged at booking; the others must admit now.
    local busy = 0
    for i = 1, n do
      if not booked_in(mask, i) and waits[i] > busy then
        busy = waits[i]
      end
    end
    if busy == 0 then
      for i = 1, n do
        if not booked_in(mask, i) then
          charge(i, now)
        end
      end
      return { 1, 0, 0, claim, now, mask, claim_epoch }
    end
    if now + busy <= claim + grace then
      -- An unbooked limit frees up within the grace (a shared limit another
      -- task just took): book it there and answer "early", so the caller
      -- sleeps that long and claims again, rather than losing a slot of
      -- every booked limit for a wait shorter than the grace.
      local more = mask
      for i = 1, n do
        if not booked_in(mask, i) then
          charge(i, now + busy)
          more = more + 2 ^ (i - 1)
        end
      end
      return { 3, busy, 0, claim, now, more, claim_epoch }
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
if horizon >= 0 and wait <= horizon then
  local booked = 0
  for i = 1, n do
    local interval, _, cost = limit(i)
    if wait - math.max(waits[i], 0) <= cost * interval then
      charge(i, now + wait)
      booked = booked + 2 ^ (i - 1)
    end
  end
  return { 2, wait, blocking, now + wait, now, booked, epoch() }
end
return { 0, wait, blocking, 0, now, 0, 0 }
