--- @include "core/bucket.lua"
--- @include "core/bell.lua"
--- @include "room/turns.lua"
--[[
Put a waiting task in line: the line of the rate limit that blocks it
(see room/lines.py).  Nothing is booked: the dispatch (serve.lua) charges its limits when its
turn comes.

KEYS[1]  the messages hash: entry id -> the task's record (record.lua: what
         the dispatch needs of it, JSON, and its message; one field per task)
KEYS[2]  the line: a sorted set, entry id -> place in line (lower first)
KEYS[3]  the ready index: a sorted set, line key -> when its limit admits its
         next start (us, server clock)
KEYS[4]  the wake list (one token: a dispatcher sleeping past the new earliest
         line wakes)
KEYS[5]  the waiting tasks' notes (a hash: task digest -> wait note, as in
         park.lua)
KEYS[6]  the line's turns (turns.lua), used when ARGV[6] is not ""
KEYS[7]  with ARGV[8] not "": the blocking rate limit's bucket (bucket.lua)
ARGV[1]  entry id
ARGV[2]  the record
ARGV[3]  place in line: its first wait (us, server clock) + its priority's
         rank x the ageing step (us)
ARGV[4]  when the blocking limit admits a start (us, server clock), 0 = now
ARGV[5]  the note's field in KEYS[5] (the task id's digest), or "": the
         task's record is its note (`celery throttle why` reads it).  An
         entry of the task's own message ("<digest>:-") is found from its id;
         another (a copy in line again) is pointed to there: "@" and its id
ARGV[6]  its fair key value's digest for a fair line (ordered by turn, not
         by place), or ""
ARGV[7]  its cost / its value's weight: how far its turn moves the value on
ARGV[8]  "": in any case.  Else (a task lined up as it arrives,
         integration/arrival.py) only if it would wait: behind tasks already
         in the line, or, the line empty, when the blocking rate limit (its
         bucket KEYS[7], ARGV[9..11] its interval, burst and cost) admits no
         start within ARGV[8] us (a pool process would put it in line then)

Reply: now (us); 0 when the entry waits already (nothing written): the
broker delivered the same message again.  With ARGV[8] not "": { how many
tasks were in the line before it (0: none, it waits for the limit's start),
or -1 when it would not wait (nothing written), or -2 when it waits
already; the blocking limit's wait (us) }
]]
now = server_us()
local entry = ARGV[1]
local behind = ARGV[8] ~= ''
local ahead, wait = 0, 0
if behind then
  ahead = redis.call('ZCARD', KEYS[2])
  if ahead == 0 then
    local tat, paused = read_rate(KEYS[7])
    wait = math.max(rate_wait({ interval = tonumber(ARGV[9]), burst = tonumber(ARGV[10]),
                                cost = tonumber(ARGV[11]) }, tat, paused), 0)
    if wait <= tonumber(ARGV[8]) then
      return { -1, wait }
    end
  end
end
if redis.call('HSETNX', KEYS[1], entry, ARGV[2]) == 0 then
  return behind and { -2, wait } or 0
end
local score = ARGV[3]
if ARGV[6] ~= '' then
  score = fair_tag(KEYS[6], ARGV[6], tonumber(ARGV[7]))
end
redis.call('ZADD', KEYS[2], score, entry)
local due = tonumber(ARGV[4])
if behind and ahead == 0 then
  due = now + wait
elseif due <= 0 then
  due = now
end
local current = tonumber(redis.call('ZSCORE', KEYS[3], KEYS[2]))
if not current or due < current then
  redis.call('ZADD', KEYS[3], due, KEYS[2])
  local first = redis.call('ZRANGE', KEYS[3], 0, 0)
  if first[1] == KEYS[2] then
    ring(KEYS[4]) -- (the dispatcher woken reads the index again)
  end
end
if ARGV[5] ~= '' then
  redis.call('HSET', KEYS[5], ARGV[5], '@' .. entry)
end
if behind then
  return { ahead, wait }
end
return now
