--- @include "room/record.lua"
--[[
celery_throttle where.lua: where each of some tasks waits (read only;
room/parking.py).

KEYS[1]  the waiting tasks' notes (hash)   KEYS[2]  the messages hash
KEYS[3]  the parked set
ARGV[1], ARGV[2], ...: per task, its field in KEYS[1] (its id's digest) and
         the entry of its own message

Reply: { entry, where, record, ... } per task: where "q" (in line: its
record's JSON follows), "p" (parked: "") or "" (not here).  A task waiting in
line as a copy is noted "@" and its entry
]]

local out = {}
for i = 1, #ARGV, 2 do
  local note, entry = redis.call('HGET', KEYS[1], ARGV[i]), ARGV[i + 1]
  if note and string.sub(note, 1, 1) == '@' then
    entry = string.sub(note, 2)
  end
  local where, record = '', ''
  if redis.call('ZSCORE', KEYS[3], entry) then
    where = 'p'
  else
    local stored = redis.call('HGET', KEYS[2], entry)
    record = stored and split_record(stored)
    where, record = record and 'q' or '', record or ''
  end
  out[#out + 1] = entry
  out[#out + 1] = where
  out[#out + 1] = record
end
return out
