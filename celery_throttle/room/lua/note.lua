--- @include "room/record.lua"
--[[
celery_throttle note.lua: a task's wait note, with the server's clock (read
only; room/parking.py; why a script: state.lua).

KEYS[1]  the task's wait note key    KEYS[2]  the waiting tasks' notes (hash)
KEYS[3]  the messages hash
ARGV[1]  the task's field in KEYS[2] (its id's digest)
ARGV[2]  the entry of its own message

Reply: { sec, usec, note or "" }: the key (a task that started, or waits as
a countdown), else the field, else "@" and that entry if it waits in line
(its record is its note: enqueue.lua)
]]

local t = redis.call('TIME')
local note = redis.call('GET', KEYS[1]) or redis.call('HGET', KEYS[2], ARGV[1])
if not note then
  local stored = redis.call('HGET', KEYS[3], ARGV[2])
  note = (stored and split_record(stored)) and ('@' .. ARGV[2]) or ''
end
return { t[1], t[2], note }
