--[[
A released task arrives at a worker: may this copy go on?

The first copy of an entry to arrive takes its message out of the waiting
room and goes on; any later copy (a releaser died after publishing, and the
entry was released again) is refused.  An acks_late task may be redelivered
by the broker after a crash mid-run (acks_late's at-least-once): that
redelivery carries the same token as the copy that went on, which a marker
remembers, and may go on again.

KEYS[1]  the messages hash
KEYS[2]  the claimed set
KEYS[3]  the arrival marker of this entry
KEYS[4]  the prefix's epoch
ARGV[1]  entry id
ARGV[2]  the token of the release that published this copy
ARGV[3]  marker TTL, milliseconds; 0 = no marker (not acks_late: its message
         was acknowledged before it got here, so it is never redelivered)
ARGV[4]  the epoch the entry was parked in

Reply: 1 this copy goes on, 0 it is a duplicate
]]
local entry = ARGV[1]
if redis.call('HDEL', KEYS[1], entry) == 1 then
  redis.call('ZREM', KEYS[2], entry)
  if tonumber(ARGV[3]) > 0 then
    redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[3])
  end
  return 1
end
if tonumber(ARGV[3]) > 0 and redis.call('GET', KEYS[3]) == ARGV[2] then
  return 1
end
if redis.call('GET', KEYS[4]) ~= ARGV[4] then
  -- The store lost its data (restart without persistence, flush) since the
  -- entry was parked: nothing tells a duplicate now, and running it beats
  -- losing it.
  return 1
end
return 0
