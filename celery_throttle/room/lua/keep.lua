--[[
A kept copy is taken by a dispatched task arriving at a worker (room/keeper.py).
Runs on the broker's Redis server, where the kept copies are.

The first copy of an entry to arrive takes the kept copy and goes on; the
broker's redelivery of that copy (acks_late) carries the same token, which the
marker remembers, and goes on again; any other copy is refused.  This holds
whatever the throttle's store lost meanwhile: a copy dispatched before a
restart of the store and one dispatched again after it are told apart here.

KEYS[1]  the kept copies (a hash: entry id -> message)
KEYS[2]  the entry's marker (a string: the token of the copy that took it)
ARGV[1]  entry id
ARGV[2]  the token of the dispatch that published this copy
ARGV[3]  marker TTL, milliseconds

Reply: 1 this copy goes on; 0 another copy took the entry (a duplicate);
-1 no kept copy and no marker: the entry was never kept here, or its marker
expired (the store's arrival decides)
]]
if redis.call('HDEL', KEYS[1], ARGV[1]) == 1 then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', tonumber(ARGV[3]))
  return 1
end
local taken = redis.call('GET', KEYS[2])
if not taken then
  return -1
end
if taken == ARGV[2] then
  return 1
end
return 0
