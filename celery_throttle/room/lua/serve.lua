--- @include "core/bucket.lua"
--- @include "core/epoch.lua"
--- @include "core/lease.lua"
--- @include "room/turns.lua"
--- @include "room/lines.lua"
--[[
celery_throttle serve.lua: serve the limits' lines: dispatch each line's best
waiting task when its limits admit it (see room/lines.py).  The charge here
is the gate's own (bucket.lua, lease.lua).

KEYS[1] messages hash   KEYS[2] ready index    KEYS[3] claimed set
KEYS[4] epoch           KEYS[5] trip estimate  KEYS[6] wake list
KEYS[7] specs hash (limit name -> "interval burst"; "T/F burst" if it learns)
KEYS[8] live overrides (limit name -> "interval burst rate", core/live.py)
KEYS[5+4j], KEYS[6+4j], KEYS[7+4j], KEYS[8+4j]  a limit's key (a rate
        bucket, or a concurrency limit's leases), its line, the line's turns
        (turns.lua) and its side key (a concurrency limit's meta hash: its
        holders' starts and pause; a rate limit's learned rate, learn.lua,
        read if it learns), j = 1..; the first ARGV[4] are the lines to serve,
        the rest are other limits of their tasks (every limit a served task
        has must be among them)
ARGV[1] the most tasks dispatched
ARGV[2] claim timeout, us (as dispatch.lua: not arrived by then, due again)
ARGV[3] entries to dispatch without a charge, at once wherever they are in
        their line (revoked: the worker drops them)
ARGV[4] the number of lines to serve
ARGV[5] the most ahead, us; ARGV[6] the dispatch lead, us (as due.lua)

A task's turn: its limits (at their live rate, else the declared one, else
the one it was enqueued with) admit it within `ahead` (lines.lua): every
one is charged for that moment (a concurrency limit: a seat is free, or it
holds one; its lease is taken in the task's id) and the task is dispatched.
A full concurrency limit admits it when a seat is given back (release.lua
makes its line due) or, failing that, when its earliest lease ends.  The
limit that blocks it is another one: it moves to that limit's line with its
place in line.  Its expiry or its max_wait passed: dispatched without a
charge (flag "x" or "t"), so the worker ends it at once.

Reply: { wait, epoch, entry, token, flag, start, message, ... }: wait as
       dispatch.lua's (0: call again now; -1: nothing due later); start: the
       moment its limits were charged for (us; 0 uncharged)
]]

now = server_us()
local TRIP_LEASE_US = 10000000 -- a served seat's lease until its copy arrives

local messages, ready, claimed = KEYS[1], KEYS[2], KEYS[3]
local specs, live = KEYS[7], KEYS[8]
local batch = tonumber(ARGV[1])
local deadline = now + tonumber(ARGV[2])
local uncharged, uncharged_list = {}, {}
for e in string.gmatch(ARGV[3], '%S+') do
  uncharged[e] = true
  uncharged_list[#uncharged_list + 1] = e
end
local nq = tonumber(ARGV[4])
local line_for, turns_of, buckets = {}, {}, {}
local meta_of = {}
for j = 1, (#KEYS - 8) / 4 do
  local b, q = KEYS[5 + 4 * j], KEYS[6 + 4 * j]
  line_for[b], turns_of[q], meta_of[b], buckets[j] = q, KEYS[7 + 4 * j], KEYS[8 + 4 * j], b
end
local ahead = ahead_of(KEYS[5], ARGV[5], ARGV[6])
local out = { 0, tonumber(epoch_of(KEYS[4], now)) }
local served = 0
-- Tasks looked at in this call, dispatched or not (moved, dropped): bounded.
local steps = 4 * batch

-- The line's limit admits its next start at `at`: look at it then (an
-- earlier look stays: another task may be due there sooner).
local function due_at(q, at, exact)
  local current = tonumber(redis.call('ZSCORE', ready, q))
  if exact or not current or at < current then
    redis.call('ZADD', ready, at, q)
  end
end

local function dispatch(q, entry, flag, at, place, fair)
  if fair then
    -- The fair line's time moves to this task's turn.
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
-- passed (the caller looks at the line again and brings it).
local function task_limits(task)
  local lims = {}
  for i, l in ipairs(task.l) do
    local key, name, interval, burst, cost, fair, units = row_of(l)
    if not line_for[key] then
      return nil
    end
    if interval == 0 then -- a seat (no live rate applies)
      lims[i] = { key = key, concurrent = true, seats = burst, lease = cost,
                  meta = meta_of[key], fair = '' }
    else
      -- (a limit that learns: "T/F", its ceiling's and floor's intervals, learn.lua;
      -- a live rate is its ceiling)
      local ceiling, floor = learning_of(interval) -- (a number reads as no match)
      local spec = redis.call('HGET', live, name) or redis.call('HGET', specs, name)
      if spec then
        local ti, bu = string.match(spec, '^(%S+) (%d+)')
        local c, f = learning_of(ti or '')
        ceiling, floor = c or (ceiling and tonumber(ti)) or ceiling, f or floor
        interval, burst = tonumber(ti) or interval, tonumber(bu) or burst
      end
      -- A burst lowered below the cost could never admit it: the cost is capped.
      lims[i] = { key = key, interval = interval, burst = burst,
                  cost = math.min(cost, burst), fair = fair or '', units = units or 1 }
      if ceiling then
        learns(lims[i], ceiling, floor, meta_of[key])
      end
    end
  end
  return lims
end

-- One line: dispatch its best tasks while their limits admit them.
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
      redis.call('DEL', turns_of[q]) -- a fair line's turns start again
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
        if line_for[lim.key] == q then
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
            charge_rate(lim, state[i][1], at, state[i][2], state[i][3])
          end
        end
        dispatch(q, entry, 'c', at, place, own ~= nil and own.fair ~= '')
      else
        local other = line_for[lims[blocking].key]
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
  local q = line_for[buckets[j]]
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
