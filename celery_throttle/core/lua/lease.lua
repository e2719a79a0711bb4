--- @include "core/bucket.lua"
--[[
celery_throttle lease.lua: a concurrency limit's seats, one copy for every
script that takes one (the gate's commands; room/lua/serve.lua, which
dispatches a waiting task), which include it.  It includes bucket.lua
(`us`; `now`: clock.lua).

A concurrency limit here is a table { key, seats, lease (us), meta }: key a
sorted set of leases (member = the holder, a task id; score = when the lease
expires), meta a hash of its pause, its average run, the waiters' pacing
cursor and its holders' starts ("s:<holder>").  Expired leases are reclaimed
before counting, so a killed worker's seat comes back within one lease time;
a running task's heartbeat renews its lease (renew.lua).  A full limit
cannot book a future seat (nobody knows when a lease ends), so waiters are
paced instead (decide.lua).
]]
local META_TTL_MS = 86400000

local function keep_at_least(key, ms)
  if redis.call('PTTL', key) < ms then
    redis.call('PEXPIRE', key, ms)
  end
end

local function meta_num(lim, field)
  return tonumber(redis.call('HGET', lim.meta, field) or 0)
end

-- Leases past their expiry are reclaimed (their holders stopped renewing:
-- killed), with the start times kept for them in the meta hash.
local function reclaim(lim)
  local gone = redis.call('ZRANGEBYSCORE', lim.key, '-inf', now)
  for _, h in ipairs(gone) do
    redis.call('ZREM', lim.key, h)
    redis.call('HDEL', lim.meta, 's:' .. h)
  end
end

-- Give `who` a lease in `lim` from `at` (us; its start is noted then), of
-- `length` us (default: the limit's lease).
local function take(lim, who, at, length)
  local lease = length or lim.lease
  redis.call('ZADD', lim.key, at + lease, who)
  keep_at_least(lim.key, math.ceil((at - now + lease) / 1000))
  redis.call('HSETNX', lim.meta, 's:' .. who, us(at))
  keep_at_least(lim.meta, META_TTL_MS)
end

-- How long until `who` may take a seat of `lim` (after reclaim): 0 while it
-- holds one or one is free, else until the lease whose end frees a seat ends
-- (its holder gives it back sooner, as a rule: the release says so), or the
-- pause.  Seats taken ahead, for leases about to end, are counted: with held
-- leases over the seats, the (held - seats + 1)th to end is the one that
-- frees a seat, not the first (each lease that ends frees one seat, once).
local function seat_wait(lim, who)
  local wait = meta_num(lim, 'pause') - now
  local held = redis.call('ZCARD', lim.key)
  if held >= lim.seats and not redis.call('ZSCORE', lim.key, who) then
    local k = held - lim.seats
    local freeing = redis.call('ZRANGE', lim.key, k, k, 'WITHSCORES')
    wait = math.max(wait, tonumber(freeing[2]) - now)
  end
  return math.max(wait, 0)
end
