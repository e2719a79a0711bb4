--- @include "core/clock.lua"
--- @include "core/limits.lua"
--- @include "core/lease.lua"
--- @include "core/bell.lua"
--[[
celery_throttle release.lua: give back a holder's leases in the concurrency
limits among those given; feed each one's average run; make the tasks
waiting in line for a seat due now (the dispatcher serves the line,
room/lua/serve.lua), not when the earliest lease would have expired.

KEYS and the limits' ARGV: limits.lua.  The command's own:
KEYS[c+j-1] the j-th concurrency limit's line of tasks waiting for a seat
            (room/queues.py), j = 1..m
KEYS[c+m]   the lines' ready index (room/queues.py)
KEYS[c+m+1] the dispatchers' wake list (room/parking.py)
ARGV[1]     now (clock.lua)
ARGV[2]     the holder (a task id)
ARGV[3]     how long the holder ran, us (its own measure; 0: the server's,
            from the start the lease noted)

Reply: the leases released (0: none held, e.g. expired)
]]

now = clock_of(ARGV[1])
local holder, ran_for = ARGV[2], tonumber(ARGV[3])
local L, n, m, own = limits_of(3)
local ready, wake = KEYS[own + m], KEYS[own + m + 1]

-- A seat given back: the line waiting for one is due now; wake a dispatcher.
local function line_due(line)
  if redis.call('EXISTS', line) == 0 then
    return
  end
  local current = tonumber(redis.call('ZSCORE', ready, line))
  if not current or current > now then
    redis.call('ZADD', ready, now, line)
    ring(wake)
  end
end

local count = 0
for i = 1, n do
  local lim = L[i]
  if lim.concurrent then
    local since = tonumber(redis.call('HGET', lim.meta, 's:' .. holder) or 0)
    redis.call('HDEL', lim.meta, 's:' .. holder)
    if redis.call('ZREM', lim.key, holder) == 1 then
      count = count + 1
      local ran = ran_for
      if ran <= 0 and since > 0 then
        ran = now - since
      end
      if ran > 0 then -- average run: moves a quarter of the way per run
        local avg = meta_num(lim, 'run')
        if avg > 0 then
          avg = math.floor((3 * avg + ran) / 4)
        else
          avg = ran
        end
        redis.call('HSET', lim.meta, 'run', us(avg))
        redis.call('PEXPIRE', lim.meta, META_TTL_MS)
      end
    end
    line_due(KEYS[own + lim.nth - 1])
  end
end
return count
