--[[
Put a waiting task in line: the queue of the rate limit that blocks it
(see room/queues.py).  turns.lua comes first (the loader joins them).  Nothing is booked: the dispatch (serve.lua) charges
its limits when its turn comes.

KEYS[1]  the messages hash: entry id -> the serialized message (parking.py's)
KEYS[2]  the entries hash: entry id -> what the dispatch needs (JSON: task id,
         expiry and max_wait deadlines, and its limits)
KEYS[3]  the queue: a sorted set, entry id -> place in line (lower first)
KEYS[4]  the ready index: a sorted set, queue key -> when its limit admits its
         next start (us, server clock)
KEYS[5]  the wake list (one token: a dispatcher sleeping past the new earliest
         queue wakes)
KEYS[6]  the waiting tasks' notes (a hash: task digest -> wait note, as in
         park.lua); a task in line has "@" and its entry id there: its entry
         and message are its note (`celery throttle why` reads them)
KEYS[7]  the queue's turns (turns.lua), used when ARGV[7] is not ""
ARGV[1]  entry id
ARGV[2]  the message (envelope.py's)
ARGV[3]  place in line: its first wait (us, server clock) + its priority's
         rank x the ageing step (us)
ARGV[4]  the entry's JSON
ARGV[5]  when the blocking limit admits a start (us, server clock), 0 = now
ARGV[6]  the note's field in KEYS[6] (the task id's digest)
ARGV[7]  its fair key value's digest for a fair queue (ordered by turn, not
         by place), or ""
ARGV[8]  its cost / its value's weight: how far its turn moves the value on

Reply: now (us); 0 when the entry waits already (nothing written): the
broker delivered the same message again
]]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local entry = ARGV[1]
if redis.call('HSETNX', KEYS[1], entry, ARGV[2]) == 0 then
  return 0
end
redis.call('HSET', KEYS[2], entry, ARGV[4])
local score = ARGV[3]
if ARGV[7] ~= '' then
  score = fair_tag(KEYS[7], ARGV[7], tonumber(ARGV[8]))
end
redis.call('ZADD', KEYS[3], score, entry)
local due = tonumber(ARGV[5])
if due <= 0 then
  due = now
end
local current = tonumber(redis.call('ZSCORE', KEYS[4], KEYS[3]))
if not current or due < current then
  redis.call('ZADD', KEYS[4], due, KEYS[3])
  local first = redis.call('ZRANGE', KEYS[4], 0, 0)
  if first[1] == KEYS[3] then
    -- One token is enough (as in park.lua): the dispatcher woken reads the
    -- index again.
    redis.call('LPUSH', KEYS[5], '1')
    redis.call('LTRIM', KEYS[5], 0, 0)
    redis.call('PEXPIRE', KEYS[5], 60000)
  end
end
redis.call('HSET', KEYS[6], ARGV[6], '@' .. entry)
return now
