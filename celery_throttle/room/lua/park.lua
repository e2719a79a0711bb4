--- @include "core/clock.lua"
--- @include "core/bell.lua"
--[[
Park a waiting task in the waiting room (see room/parking.py).

The message waits in Redis, scored by when it is due (a provider's pause
over, a restored task's time) on this server's clock, instead of sitting in
a worker's memory as a Celery ETA message.

KEYS[1]  the parked set: member = entry id, score = dispatch time (us)
KEYS[2]  the messages hash: entry id -> the serialized message
KEYS[3]  the wake list: one token, pushed when this entry is the new earliest,
         so a dispatcher sleeping until a later dispatch wakes at once
KEYS[4]  the waiting tasks' notes (a hash: task digest -> wait note, for
         `celery throttle why`; arrive.lua moves a note to a key of its own)
ARGV[1]  entry id
ARGV[2]  the message (envelope JSON)
ARGV[3]  dispatch time, microseconds of this server's clock; 0 = now + ARGV[4]
ARGV[4]  delay, microseconds (used when ARGV[3] is 0)
ARGV[5]  the wait note (JSON), "" for none; its "due" is the dispatch time
ARGV[6]  the note's field in KEYS[4] (the task id's digest)

Reply: { dispatch time (us), now (us) }; dispatch time 0 when the entry is
parked already (nothing written): the broker delivered the same message again
]]
now = server_us()
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
  ring(KEYS[3])
end
if ARGV[5] ~= '' then
  -- A field, not a key with a TTL: a key costs about 400 bytes of Redis per
  -- waiting task, a field of one hash about 150.
  redis.call('HSET', KEYS[4], ARGV[6], ARGV[5])
end
return { at, now }
