--[[
Park a waiting task in the waiting room (see room/parking.py).

The message waits in Redis, scored by when it is to be dispatched to its
queue (its slot less the dispatch lead) on this server's clock, instead of
sitting in a worker's memory as a Celery ETA message.

KEYS[1]  the parked set: member = entry id, score = dispatch time (us)
KEYS[2]  the messages hash: entry id -> the serialized message
KEYS[3]  the wake list: one token, pushed when this entry is the new earliest,
         so a dispatcher sleeping until a later dispatch wakes at once
KEYS[4]  the waiting tasks' notes (a hash: task digest -> wait note, for
         `celery throttle why`; arrive.lua moves a note to a key of its own)
KEYS[5]  a concurrency limit's waiters: a sorted set of "entry holder" by place
         (gate.lua hands a freed seat to the first), or any key when ARGV[7] is "".
         (An earlier version kept a list, oldest first: while one remains, a
         waiter is appended to it, and gate.lua empties it first.)
ARGV[1]  entry id
ARGV[2]  the message (envelope JSON)
ARGV[3]  dispatch time, microseconds of this server's clock; 0 = now + ARGV[4]
ARGV[4]  delay, microseconds (used when ARGV[3] is 0)
ARGV[5]  the wait note (JSON), "" for none; its "due" is the dispatch time
ARGV[6]  the note's field in KEYS[4] (the task id's digest)
ARGV[7]  "entry holder" to add to the waiters, or ""
ARGV[8]  the item this task had there before (it came back and waits again):
         replaced, so the task keeps its turn; or ""
ARGV[9]  the task's place among the waiters (us: when it first waited plus its
         priority's ageing steps, as in a limit's queue, room/queues.py)

Reply: { dispatch time (us), now (us) }; dispatch time 0 when the entry is
parked already (nothing written): the broker delivered the same message again
]]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local at = tonumber(ARGV[3])
if at <= 0 then
  at = now + tonumber(ARGV[4])
end
local entry = ARGV[1]
if redis.call('HSETNX', KEYS[2], entry, ARGV[2]) == 0 then
  return { 0, now }
end
redis.call('ZADD', KEYS[1], at, entry)
local first = redis.call('ZRANGE', KEYS[1], 0, 0)
if first[1] == entry then
  -- One token is enough: any dispatcher may dispatch any entry, and the one
  -- woken goes back to sleep until the next dispatch time it reads.
  redis.call('LPUSH', KEYS[3], '1')
  redis.call('LTRIM', KEYS[3], 0, 0)
  redis.call('PEXPIRE', KEYS[3], 60000)
end
if ARGV[5] ~= '' then
  -- A field, not a key with a TTL: a key costs about 400 bytes of Redis per
  -- waiting task, a field of one hash about 150.
  redis.call('HSET', KEYS[4], ARGV[6], ARGV[5])
end
if ARGV[7] ~= '' then
  if redis.call('TYPE', KEYS[5]).ok == 'list' then
    local turn = ARGV[8] ~= '' and redis.call('LPOS', KEYS[5], ARGV[8]) -- Redis >= 6.0.6
    if turn then
      redis.call('LSET', KEYS[5], turn, ARGV[7])
    else
      redis.call('RPUSH', KEYS[5], ARGV[7])
    end
  else
    local place = ARGV[8] ~= '' and redis.call('ZSCORE', KEYS[5], ARGV[8])
    if place then
      redis.call('ZREM', KEYS[5], ARGV[8])
    else
      place = ARGV[9]
    end
    redis.call('ZADD', KEYS[5], place, ARGV[7])
  end
  redis.call('PEXPIRE', KEYS[5], math.max(1, math.ceil((at - now) / 1000)) + 86400000)
end
return { at, now }
