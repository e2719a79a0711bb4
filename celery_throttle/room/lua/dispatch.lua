--- @include "core/clock.lua"
--- @include "core/epoch.lua"
--[[
Claim the parked tasks that are due, for one dispatcher to publish.

A claimed entry moves to the claimed set with a deadline; it leaves it when
the dispatched message arrives at a worker (arrive.lua).  A dispatcher killed
after claiming, or a message lost on the way, leaves the entry there past
its deadline: it is then due again and dispatched once more (the arrival
drops all but the first copy that arrives).

KEYS[1]  the parked set (score = dispatch time, us)
KEYS[2]  the messages hash
KEYS[3]  the claimed set (score = deadline, us)
KEYS[4]  the prefix's epoch (epoch.lua): a dispatched
         copy carries it, so its arrival can tell a store that lost its data
         (a new epoch) from one where another copy arrived first
KEYS[5]  the trip estimate (arrive.lua): entries are dispatched this much
         ahead of their dispatch time, so that they reach a worker by then
         even while the workers are busy (taking in a backlog of fresh tasks)
ARGV[1]  batch: the most entries claimed per call
ARGV[2]  claim timeout, microseconds

Reply: { wait, epoch, entry 1, token 1, message 1, entry 2, ... }
  wait     microseconds until the next dispatch time; 0 when more are due
           now (a full batch); -1 when nothing is parked
  token    this claim's id, unique per entry and claim (a re-dispatch gets
           another): the arrival tells a broker's redelivery of one publish
           from a second publish of the same entry
]]
now = server_us()
local batch = tonumber(ARGV[1])
local deadline = now + tonumber(ARGV[2])
local est = redis.call('HMGET', KEYS[5], 'avg', 'dev')
-- Ahead by the usual trip and twice its deviation.
local ahead = math.floor((tonumber(est[1]) or 0) + 2 * (tonumber(est[2]) or 0))
local horizon = now + ahead

-- Claims past their deadline whose message has not arrived: due again.
for _, e in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, batch)) do
  redis.call('ZREM', KEYS[3], e)
  if redis.call('HEXISTS', KEYS[2], e) == 1 then
    redis.call('ZADD', KEYS[1], now, e)
  end
end

local out = { 0, tonumber(epoch_of(KEYS[4], now)) }
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', horizon, 'LIMIT', 0, batch)
for i, e in ipairs(due) do
  redis.call('ZREM', KEYS[1], e)
  local message = redis.call('HGET', KEYS[2], e)
  if message then
    redis.call('ZADD', KEYS[3], deadline, e)
    out[#out + 1] = e
    out[#out + 1] = string.format('%d.%d', now, i)
    out[#out + 1] = message
  end
end
if #due < batch then
  local nxt = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if nxt[1] then
    out[1] = math.max(1, tonumber(nxt[2]) - horizon)
  else
    -- Nothing parked; a claim may still time out: look again by then.
    local claim = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
    out[1] = claim[1] and math.max(1, tonumber(claim[2]) - now) or -1
  end
end
return out
