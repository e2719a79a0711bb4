--- @include "core/clock.lua"
--- @include "room/record.lua"
--[[
celery_throttle lines.lua: what the scripts serving the limits' lines share
(due.lua, heads.lua, serve.lua, withdraw.lua; see room/lines.py).

Ahead: a line is served ahead of its limit's next start by the dispatch
lead plus the trip from dispatch to arrival (parking.py's estimate), as a
parked task is dispatched, at most the given most: the task sleeps the rest
of it in a worker process, which a long estimate (a node starting up delays a
few arrivals by seconds) must not fill.  The lead is also all there is
before the first arrival has measured a trip.
]]

-- How far ahead lines are served: `trip` the trip estimate (a hash: "avg",
-- "dev", us), `most` and `lead` (us) as the callers' ARGV name them.
local function ahead_of(trip, most, lead)
  local est = redis.call('HMGET', trip, 'avg', 'dev')
  return math.min(tonumber(most), math.floor(tonumber(lead) + (tonumber(est[1]) or 0)
                                             + 2 * (tonumber(est[2]) or 0)))
end

-- How long until the earliest line of the ready index is due (>= 1 us), or -1.
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

-- Claim a waiting task for dispatch (the caller took it out of its line):
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
