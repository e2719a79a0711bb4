--- @include "room/record.lua"
--[[
Reads of the waiting room and of a task's wait note, each with the clock of
the server that holds the keys, in one call.

Why a script and not a pipeline with TIME: on a Redis Cluster the keys of a
prefix live on one node (their hash tag), and TIME sent beside them would go
to any node (redis-py refuses a pipelined TIME there); a script runs where
its keys are.  The purge is here too, for the same reason (no MULTI needed).

ARGV[1]  the operation:
  "state"  KEYS[1] parked (zset), KEYS[2] claimed (zset)
           -> {sec, usec, parked count, claimed count, first score or ""}
  "peek"   KEYS[1] parked, KEYS[2] messages (hash); ARGV[2] count
           -> {sec, usec, entry, score, message, entry, score, message, ...}
  "purge"  KEYS[1] parked, KEYS[2] messages, KEYS[3] claimed, KEYS[4] wake,
           KEYS[5] the waiting tasks' notes
           -> the messages dropped (stored envelopes: compressed, so the
              caller reads their task ids, to mark them revoked)
  "note"   KEYS[1] a task's wait note key, KEYS[2] the waiting tasks' notes,
           KEYS[3] messages; ARGV[2] the task's field in KEYS[2], ARGV[3]
           the entry of its own message -> {sec, usec, note or ""}: the key
           (a task that started, or waits as a countdown), else the field,
           else "@" and that entry if it waits in line (its record is its
           note: enqueue.lua)
  "where"  KEYS[1] the waiting tasks' notes, KEYS[2] messages, KEYS[3] parked;
           ARGV[2], ARGV[3], ...: per task, its field in KEYS[1] (its id's
           digest) and the entry of its own message
           -> {entry, where, record, ...} per task: where "q" (in line: its
              record's JSON follows), "p" (parked: "") or "" (not here).  A
              task waiting in line as a copy noted "@" and its entry
Scores are microseconds on the server clock, returned as strings.
]]
local op = ARGV[1]
local t = redis.call('TIME')

if op == 'state' then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {t[1], t[2], redis.call('ZCARD', KEYS[1]), redis.call('ZCARD', KEYS[2]),
          first[2] or ''}
elseif op == 'peek' then
  local out = {t[1], t[2]}
  local first = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[2]) - 1, 'WITHSCORES')
  for i = 1, #first, 2 do
    out[#out + 1] = first[i]
    out[#out + 1] = first[i + 1]
    out[#out + 1] = redis.call('HGET', KEYS[2], first[i]) or ''
  end
  return out
elseif op == 'purge' then
  local messages = redis.call('HVALS', KEYS[2])
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5])
  return messages
elseif op == 'note' then
  local note = redis.call('GET', KEYS[1]) or redis.call('HGET', KEYS[2], ARGV[2])
  if not note then
    local stored = redis.call('HGET', KEYS[3], ARGV[3])
    note = (stored and split_record(stored)) and ('@' .. ARGV[3]) or ''
  end
  return {t[1], t[2], note}
elseif op == 'where' then
  local out = {}
  for i = 2, #ARGV, 2 do
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
end
return redis.error_reply('look.lua: unknown operation ' .. tostring(op))
