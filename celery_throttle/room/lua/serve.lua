--- @include "core/bucket.lua"
--- @include "core/epoch.lua"
--- @include "core/lease.lua"
--- @include "room/turns.lua"
--- @include "room/record.lua"
--[[
Serve the limits' queues: dispatch each queue's best waiting task when its
limits admit it (see room/queues.py).  The charge here is the gate's own
(bucket.lua, lease.lua).

Three operations, ARGV[1]:

"look"   which queues are due.
  KEYS[1] the ready index (queue key -> when its limit admits a start, us)
  KEYS[2] the trip estimate (parking.py): a queue is due this much ahead
  ARGV[2] the most queues returned
  ARGV[3] the most ahead, us (queues.MAX_AHEAD_US)
  ARGV[4] the dispatch lead, us (throttle_dispatch_lead)
  Reply: { now, ahead, next, queue 1, queue 2, ... }: next is the earliest
         time (us) of a queue not due yet, or -1

"heads"  the first waiting tasks of the given queues (read only).
  KEYS[1] the messages hash; KEYS[2..] the queues
  ARGV[2] how many per queue
  Reply: { queue count, entry 1, its record's JSON, entry 2, ... } per queue,
         in order

A task's record is in the messages hash, before its message (record.lua).

"serve"  dispatch.
  KEYS[1] messages hash   KEYS[2] ready index    KEYS[3] claimed set
  KEYS[4] epoch           KEYS[5] trip estimate  KEYS[6] wake list
  KEYS[7] specs hash (limit name -> "interval burst")
  KEYS[8] live overrides (limit name -> "interval burst rate", core/live.py)
  KEYS[5+4j], KEYS[6+4j], KEYS[7+4j], KEYS[8+4j]  a limit's key (a rate
          bucket, or a concurrency limit's leases), its queue, the queue's
          turns (turns.lua) and its meta hash (a concurrency limit's: its
          holders' starts and pause), j = 1..; the first ARGV[5] are the
          queues to serve, the rest are other limits of their tasks (every
          limit a served task has must be among them)
  ARGV[2] the most tasks dispatched
  ARGV[3] claim timeout, us (as dispatch.lua: not arrived by then, due again)
  ARGV[4] entries to dispatch without a charge, at once wherever they are in
          their queue (revoked: the worker drops them)
  ARGV[5] the number of queues to serve
  ARGV[6] the most ahead, us; ARGV[7] the dispatch lead, us (as "look")
  A task's turn: its limits (at their live rate, else the declared one, else
  the one it was enqueued with) admit it within `ahead`: every one is charged
  for that moment (a concurrency limit: a seat is free, or it holds one; its
  lease is taken in the task's id) and the task is dispatched.  A full
  concurrency limit admits it when a seat is given back (release.lua
  makes its queue due) or, failing that, when its earliest lease ends.  The
  limit that blocks it is another one: it moves to that limit's queue with
  its place in line.  Its expiry or its
  max_wait passed: dispatched without a charge (flag "x" or "t"), so the
  worker ends it at once.
  Reply: { wait, epoch, entry, token, flag, start, message, ... }: wait as
         dispatch.lua's (0: call again now; -1: nothing due later); start:
         the moment its limits were charged for (us; 0 uncharged)

"cancel" revoked tasks leave at once, wherever they wait (room/parking.py's
  WaitingRoom.cancel found their entries).
  KEYS[1] messages hash   KEYS[2] claimed set    KEYS[3] epoch
  KEYS[4] parked set      KEYS[5] wake list
  KEYS[6..] the queues the entries in line wait in (each in one of them)
  ARGV[2] claim timeout, us (as "serve")
  ARGV[3] entries in line (space-separated): taken out of their queue and
          dispatched without a charge (flag "x"), the worker drops them
  ARGV[4] parked entries (space-separated): due now (dispatch.lua claims
          them next), so their worker drops them now, not at their time
  Reply: { parked entries made due, epoch, entry, token, flag, start, message,
         ... } (start 0)

Ahead: a queue is served ahead of its limit's next start by the dispatch
lead plus the trip from dispatch to arrival (parking.py's estimate), as a
parked task is dispatched, at most the given most: the task sleeps the rest
of it in a worker process, which a long estimate (a node starting up delays a
few arrivals by seconds) must not fill.  The lead is also all there is
before the first arrival has measured a trip.
]]
local t = redis.call('TIME')
now = tonumber(t[1]) * 1000000 + tonumber(t[2]) -- declared by bucket.lua
local op = ARGV[1]
local TRIP_LEASE_US = 10000000 -- a served seat's lease until its copy arrives

local function ahead_of(trip, most, lead)
  local est = redis.call('HMGET', trip, 'avg', 'dev')
  return math.min(tonumber(most), math.floor(tonumber(lead) + (tonumber(est[1]) or 0)
                                             + 2 * (tonumber(est[2]) or 0)))
end

local function next_due(ready, ahead)
  local first = redis.call('ZRANGE', ready, 0, 0, 'WITHSCORES')
  if not first[1] then
    return -1
  end
  return math.max(1, tonumber(first[2]) - ahead - now)
end

-- An entry's record (JSON), or nil once its message is gone (purged).
local function record_of(messages, entry)
  local stored = redis.call('HGET', messages, entry)
  if not stored then
    return nil
  end
  return (split_record(stored))
end

if op == 'look' then
  local ahead = ahead_of(KEYS[2], ARGV[3], ARGV[4])
  local out = { now, ahead, -1 }
  local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now + ahead, 'LIMIT', 0,
                         tonumber(ARGV[2]))
  for _, q in ipairs(due) do
    out[#out + 1] = q
  end
  if #due == 0 then
    out[3] = next_due(KEYS[1], ahead)
  end
  return out
end

if op == 'heads' then
  local out = {}
  for j = 2, #KEYS do
    local entries = redis.call('ZRANGE', KEYS[j], 0, tonumber(ARGV[2]) - 1)
    out[#out + 1] = #entries
    for _, e in ipairs(entries) do
      out[#out + 1] = e
      out[#out + 1] = record_of(KEYS[1], e) or ''
    end
  end
  return out
end

-- Claim a waiting task for dispatch (the caller took it out of its queue):
-- it goes out as a parked task does (dispatch.lua dispatches it again if no
-- copy arrives by `deadline`).  Appends { entry, token, flag, start, message }
-- to `out`; false once its message is gone (purged).
local function hand_out(out, messages, claimed, deadline, entry, flag, at)
  local stored = redis.call('HGET', messages, entry)
  if not stored then
    return false
  end
  local record, message = split_record(stored)
  if record then
    redis.call('HSET', messages, entry, message)
  end
  redis.call('ZADD', claimed, deadline, entry)
  out[#out + 1] = entry
  out[#out + 1] = string.format('%d.%d', now, #out)
  out[#out + 1] = flag
  out[#out + 1] = at
  out[#out + 1] = message
  return true
end

if op == 'cancel' then
  local out = { 0, tonumber(epoch_of(KEYS[3], now)) }
  local deadline = now + tonumber(ARGV[2])
  for e in string.gmatch(ARGV[3], '%S+') do
    local taken = false
    for j = 6, #KEYS do
      taken = redis.call('ZREM', KEYS[j], e) == 1 or taken
    end
    if taken then
      hand_out(out, KEYS[1], KEYS[2], deadline, e, 'x', 0)
    end
  end
  for e in string.gmatch(ARGV[4], '%S+') do
    out[1] = out[1] + redis.call('ZADD', KEYS[4], 'XX', 'CH', now, e)
  end
  if out[1] > 0 then -- (one token, as park.lua)
    redis.call('LPUSH', KEYS[5], '1')
    redis.call('LTRIM', KEYS[5], 0, 0)
    redis.call('PEXPIRE', KEYS[5], 60000)
  end
  return out
end

if op ~= 'serve' then
  return redis.error_reply('celery_throttle serve.lua: unknown op ' .. tostring(op))
end

local messages, ready, claimed = KEYS[1], KEYS[2], KEYS[3]
local specs, live = KEYS[7], KEYS[8]
local batch = tonumber(ARGV[2])
local deadline = now + tonumber(ARGV[3])
local uncharged, uncharged_list = {}, {}
for e in string.gmatch(ARGV[4], '%S+') do
  uncharged[e] = true
  uncharged_list[#uncharged_list + 1] = e
end
local nq = tonumber(ARGV[5])
local queue_of, turns_of, buckets = {}, {}, {}
local meta_of = {}
for j = 1, (#KEYS - 8) / 4 do
  local b, q = KEYS[5 + 4 * j], KEYS[6 + 4 * j]
  queue_of[b], turns_of[q], meta_of[b], buckets[j] = q, KEYS[7 + 4 * j], KEYS[8 + 4 * j], b
end
local ahead = ahead_of(KEYS[5], ARGV[6], ARGV[7])
local out = { 0, tonumber(epoch_of(KEYS[4], now)) }
local served = 0
-- Tasks looked at in this call, dispatched or not (moved, dropped): bounded.
local steps = 4 * batch

-- The queue's limit admits its next start at `at`: look at it then (an
-- earlier look stays: another task may be due there sooner).
local function due_at(q, at, exact)
  local current = tonumber(redis.call('ZSCORE', ready, q))
  if exact or not current or at < current then
    redis.call('ZADD', ready, at, q)
  end
end

local function dispatch(q, entry, flag, at, place, fair)
  if fair then
    -- The fair queue's time moves to this task's turn.
    redis.call('HSET', turns_of[q], '~', place)
  end
  redis.call('ZREM', q, entry)
  if hand_out(out, messages, claimed, deadline, entry, flag, at) then
    served = served + 1
  end
end

-- A record's limit row: { bucket, interval, burst, cost[, fair, units] }, the
-- limit's name read from its bucket key (keys.py's split_limit_key).  A
-- concurrency limit's row is { leases, 0, seats, lease (us) }.
local function row_of(l)
  return l[1], string.match(l[1], '^[^}]*}:[bl]:[^:]*:(.*)$'), l[2], l[3], l[4], l[5], l[6]
end

-- The task's limits as they are now; nil when one of its buckets was not
-- passed (the caller looks at the queue again and brings it).
local function task_limits(task)
  local lims = {}
  for i, l in ipairs(task.l) do
    local key, name, interval, burst, cost, fair, units = row_of(l)
    if not queue_of[key] then
      return nil
    end
    if interval == 0 then -- a seat (no live rate applies)
      lims[i] = { key = key, concurrent = true, slots = burst, lease = cost,
                  meta = meta_of[key], fair = '' }
    else
      local spec = redis.call('HGET', live, name) or redis.call('HGET', specs, name)
      if spec then
        local ti, bu = string.match(spec, '^(%d+) (%d+)')
        interval, burst = tonumber(ti) or interval, tonumber(bu) or burst
      end
      -- A burst lowered below the cost could never admit it: the cost is capped.
      lims[i] = { key = key, interval = interval, burst = burst,
                  cost = math.min(cost, burst), fair = fair or '', units = units or 1 }
    end
  end
  return lims
end

-- One queue: dispatch its best tasks while their limits admit them.
local function serve(q)
  -- Revoked tasks leave at once, wherever they wait in line (uncharged: the
  -- worker drops them and marks them REVOKED), not when their turn comes.
  for _, e in ipairs(uncharged_list) do
    local place = served < batch and redis.call('ZSCORE', q, e)
    if place then
      dispatch(q, e, 'x', 0, place, false)
    end
  end
  while served < batch and steps > 0 do
    steps = steps - 1
    local head = redis.call('ZRANGE', q, 0, 0, 'WITHSCORES')
    if not head[1] then
      redis.call('ZREM', ready, q)
      redis.call('DEL', turns_of[q]) -- a fair queue's turns start again
      return
    end
    local entry, place = head[1], head[2]
    local raw = record_of(messages, entry)
    local task = raw and cjson.decode(raw)
    if not task then
      redis.call('ZREM', q, entry) -- its message is gone (purged): nothing to dispatch
    elseif uncharged[entry] or ((task.e or 0) > 0 and now >= task.e) then
      dispatch(q, entry, 'x', 0, place, false)
    elseif (task.w or 0) > 0 and now >= task.w then
      dispatch(q, entry, 't', 0, place, false)
    else
      local lims = task_limits(task)
      if not lims then
        due_at(q, now, true)
        return
      end
      local wait, blocking, state, own = 0, 1, {}, nil
      for i, lim in ipairs(lims) do
        if queue_of[lim.key] == q then
          own = lim
        end
        local w
        if lim.concurrent then
          reclaim(lim)
          w = seat_wait(lim, task.t)
        else
          local tat, paused, shift = read_rate(lim.key)
          state[i] = { math.max(tat, now), paused, shift }
          w = rate_wait(lim, state[i][1], paused)
        end
        if w > wait then
          wait, blocking = w, i
        end
      end
      if wait <= ahead then
        local at = now + math.max(wait, 0)
        for i, lim in ipairs(lims) do
          if lim.concurrent then
            -- Held for the copy's trip only: its arrival renews it for a whole
            -- lease, and a copy that never comes (stuck with a node or a broker
            -- that went down) blocks the seat for a trip's allowance, not a lease.
            take(lim, task.t, at, math.min(lim.lease, TRIP_LEASE_US))
          else
            write_rate(lim.key, charged(lim, state[i][1], at), state[i][2], state[i][3])
          end
        end
        dispatch(q, entry, 'c', at, place, own ~= nil and own.fair ~= '')
      else
        local other = queue_of[lims[blocking].key]
        if other == q then
          due_at(q, now + wait, true)
          return
        end
        -- Another of its limits blocks it: it waits in that one's line,
        -- keeping its place (a fair line gives it its value's next turn).
        local to = lims[blocking]
        local score = task.p or tonumber(place) -- (no fair limit: its place is its score)
        if to.fair ~= '' then
          score = fair_tag(turns_of[other], to.fair, to.units)
        end
        redis.call('ZREM', q, entry)
        redis.call('ZADD', other, string.format('%.17g', score), entry)
        due_at(other, now + wait, false)
      end
    end
  end
end

for j = 1, nq do
  local q = queue_of[buckets[j]]
  -- Served already by an earlier call, or not due after all: look again later.
  local score = tonumber(redis.call('ZSCORE', ready, q))
  if score and score <= now + ahead then
    serve(q)
  end
end
if served < batch and steps > 0 then
  out[1] = next_due(ready, ahead)
end
return out
