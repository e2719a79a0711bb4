--[[
celery_throttle gate: one atomic decision over one or more GCRA buckets.

GCRA (the leaky bucket as a meter) keeps one integer per bucket: the
theoretical arrival time TAT, in microseconds of the decision clock.  For an
emission interval T, a burst B and a cost c, a start at `now` is allowed when

    max(TAT, now) + c*T - B*T <= now

and then TAT becomes max(TAT, now) + c*T.  Several buckets are decided all or
nothing: either every bucket admits and every bucket is charged, or none is
written.  This script is the only copy of the algorithm.

KEYS[i]   the bucket of limit i (all share one hash tag; see keys.py)

ARGV[1]   now, integer microseconds; "" or "0" = use this server's TIME
ARGV[2]   reservation horizon, integer microseconds; -1 = never reserve.
          When denied and the wait is <= horizon, the earliest common slot S is
          booked in every bucket and returned, so N waiting jobs get N distinct,
          evenly spaced start times instead of returning all at once.
ARGV[3]   claim: the slot S (microseconds) this caller booked earlier, or 0
ARGV[4]   claim grace, integer microseconds: a claim is honoured from S up to
          S + grace; later, it is void and a fresh decision is made (a late
          start in an old slot would crowd a newer window and break the bound)
ARGV[3+3i-2 .. 3+3i] for limit i = 1..n (ARGV[5], ARGV[6], ARGV[7] for i = 1):
          interval T (integer microseconds >= 1), burst B (integer >= 1),
          cost c (integer, 1 <= c <= B; checked by the caller)

Reply: { status, wait_us, blocking, slot_us, now_us } (integers only)
  status   1 allowed (charged now, or a claim honoured), 0 denied (nothing
           written), 2 reserved (slot booked, start at slot_us), 3 early (a
           claim for a slot still ahead; nothing written, wait wait_us)
  wait_us  microseconds until the start may happen (0 when allowed)
  blocking the 1-based index of the limit that forced the longest wait, or 0
  slot_us  the booked or claimed slot, or 0
  now_us   the clock this decision used
]]

local now = tonumber(ARGV[1]) or 0
if now <= 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local horizon = tonumber(ARGV[2])
local claim = tonumber(ARGV[3])
local grace = tonumber(ARGV[4])

if claim > 0 then
  if now < claim then
    return { 3, claim - now, 0, claim, now }
  end
  if now <= claim + grace then
    return { 1, 0, 0, claim, now }
  end
end

local n = #KEYS
local tats = {}
local wait, blocking = 0, 0
for i = 1, n do
  local base = 3 + 3 * i
  local interval = tonumber(ARGV[base - 1])
  local burst = tonumber(ARGV[base])
  local cost = tonumber(ARGV[base + 1])
  local tat = tonumber(redis.call('GET', KEYS[i]) or 0)
  if tat < now then
    tat = now
  end
  tats[i] = tat
  local w = tat + (cost - burst) * interval - now
  if w > wait then
    wait, blocking = w, i
  end
end

local function charge(at)
  -- Write, then TTL = time until the bucket has drained (TAT reached): the
  -- key can never expire while it still holds state, and idle buckets vanish.
  for i = 1, n do
    local base = 3 + 3 * i
    local tat = tats[i]
    if tat < at then
      tat = at
    end
    tat = tat + tonumber(ARGV[base + 1]) * tonumber(ARGV[base - 1])
    local ttl_ms = math.ceil((tat - now) / 1000)
    if ttl_ms < 1 then
      ttl_ms = 1
    end
    -- %d: Lua's default number formatting would round a 16-digit TAT.
    redis.call('SET', KEYS[i], string.format('%d', tat), 'PX', ttl_ms)
  end
end

if wait <= 0 then
  charge(now)
  return { 1, 0, 0, 0, now }
end
if horizon >= 0 and wait <= horizon then
  charge(now + wait)
  return { 2, wait, blocking, now + wait, now }
end
return { 0, wait, blocking, 0, now }
