--[[
celery_throttle purge.lua: drop every parked task of the waiting room, in one
call (room/parking.py; a script runs where its keys are, as state.lua says,
and needs no MULTI).

KEYS[1]  the parked set        KEYS[2]  the messages hash
KEYS[3]  the claimed set       KEYS[4]  the wake list
KEYS[5]  the waiting tasks' notes

Reply: the messages dropped (stored envelopes: compressed, so the caller
reads their task ids, to mark them revoked)
]]

local messages = redis.call('HVALS', KEYS[2])
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5])
return messages
