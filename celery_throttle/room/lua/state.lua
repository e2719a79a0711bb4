--[[
celery_throttle state.lua: how many tasks are parked and claimed, and the
first parked one's time, with the clock of the server that holds them (read
only; room/parking.py).

Why a script and not a pipeline with TIME (here and in peek.lua, note.lua,
purge.lua): on a Redis Cluster the keys of a prefix live on one node (their
hash tag), and TIME sent beside them would go to any node (redis-py refuses
a pipelined TIME there); a script runs where its keys are.

KEYS[1]  the parked set    KEYS[2]  the claimed set

Reply: { sec, usec, parked count, claimed count, first score or "" }; scores
are microseconds on the server clock, returned as strings
]]

local t = redis.call('TIME')
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return { t[1], t[2], redis.call('ZCARD', KEYS[1]), redis.call('ZCARD', KEYS[2]),
         first[2] or '' }
