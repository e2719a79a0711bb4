--- @include "core/clock.lua"
--[[
A dispatched task arrives at a worker: may this copy go on?

The first copy of an entry to arrive takes its message out of the waiting
room and goes on; any later copy (a dispatcher died after publishing, and the
entry was dispatched again) is refused.  An acks_late task may be redelivered
by the broker after a crash mid-run (acks_late's at-least-once): that
redelivery carries the same token as the copy that went on, which a marker
remembers, and may go on again.  A restore from the ledger writes the same
marker for each entry a copy took before the store's loss.

KEYS[1]  the messages hash
KEYS[2]  the claimed set
KEYS[3]  the arrival marker of this entry
KEYS[4]  the prefix's epoch
KEYS[5]  the waiting room's trip estimate (a hash: "avg" and "dev", us)
KEYS[6]  the waiting tasks' notes (park.lua's hash)
KEYS[7]  the task's own wait note key, where its note moves for ARGV[6] ms
ARGV[1]  entry id
ARGV[2]  the token of the dispatch that published this copy
ARGV[3]  marker TTL, milliseconds; 0 = no marker (not acks_late: its message
         was acknowledged before it got here, so it is never redelivered)
ARGV[4]  the epoch the entry was parked in
ARGV[5]  the task's field in KEYS[6] (its id's digest), "" for none
ARGV[6]  how long the moved note is kept, milliseconds
ARGV[7]  the longest trip that counts, us (lines.MAX_AHEAD_US)
ARGV[8]  how long the worker's consumer held this copy before its pool got it,
         us (integration/arrival.py): not part of the way there

The first arrival also measures the trip from its dispatch (the token is
"<dispatch time>.<n>") into the trip estimate the dispatcher dispatches ahead by.
A trip longer than the most a task is dispatched ahead is a wait in a queue (a
lane backed up, a copy restored after its node died), not the way there: it is
left out, since counting it would have every timely copy after it sleep the
difference in a worker process, and those sleeps back the lane up further.

Reply: this server's time (us, > 0) when this copy goes on, 0 when it is a
duplicate
]]
local entry = ARGV[1]
now = server_us()
if redis.call('HDEL', KEYS[1], entry) == 1 then
  redis.call('ZREM', KEYS[2], entry)
  if ARGV[5] ~= '' then
    -- `celery throttle why` still answers for a minute after the start.
    local note = redis.call('HGET', KEYS[6], ARGV[5])
    if note then
      -- (A task in line noted only its entry, gone now: nothing to keep.)
      if string.sub(note, 1, 1) ~= '@' then
        redis.call('SET', KEYS[7], note, 'PX', tonumber(ARGV[6]))
      end
      redis.call('HDEL', KEYS[6], ARGV[5])
    end
  end
  local dispatched = tonumber(string.match(ARGV[2], '^(%d+)%.'))
  local trip = dispatched and math.max(now - dispatched - tonumber(ARGV[8] or 0), 0)
  if trip and trip <= tonumber(ARGV[7]) then
    -- Moving averages of the trip and of its deviation, an eighth of the way
    -- per arrival (as TCP estimates a round trip).
    local avg = tonumber(redis.call('HGET', KEYS[5], 'avg') or trip)
    local dev = tonumber(redis.call('HGET', KEYS[5], 'dev') or 0)
    dev = dev + (math.abs(trip - avg) - dev) / 8
    avg = avg + (trip - avg) / 8
    redis.call('HSET', KEYS[5], 'avg', string.format('%d', avg), 'dev', string.format('%d', dev))
    redis.call('PEXPIRE', KEYS[5], 86400000)
  end
  if tonumber(ARGV[3]) > 0 then
    redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[3])
  end
  return now
end
local went = redis.call('GET', KEYS[3])
if went then
  -- The copy that went on (an acks_late one's marker, or a restore's from the
  -- ledger: room/logged.py): its redelivery goes on again, any other is refused.
  if went == ARGV[2] then
    return now
  end
  return 0
end
if redis.call('GET', KEYS[4]) ~= ARGV[4] then
  -- The store lost its data (restart without persistence, flush) since the
  -- entry was parked: nothing tells a duplicate now, and running it beats
  -- losing it.
  return now
end
return 0
