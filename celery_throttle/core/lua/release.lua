--- @include "core/clock.lua"
--- @include "core/limits.lua"
--- @include "core/lease.lua"
--- @include "core/bell.lua"
--[[
celery_throttle release.lua: give back a holder's leases in the concurrency
limits among those given; feed each one's average run; a line of tasks
waiting for a freed seat is due now, not when the earliest lease would have
expired: it goes into the freed set and the doorbell rings (the waiting
room's dispatch moves it to its ready index, room/lua/due.lua).

KEYS and the limits' ARGV: limits.lua.  The command's own:
KEYS[c+j-1] the j-th concurrency limit's line of tasks waiting for a seat
            (keys.py), j = 1..m (read)
KEYS[c+m]   the freed set (keys.py freed_key)
KEYS[c+m+1] the doorbell (bell.lua)
ARGV[1]     now (clock.lua)
ARGV[2]     the holder (a task id)
ARGV[3]     how long the holder ran, us (its own measure; 0: the server's,
            from the start the lease noted)

Reply: the leases released (0: none held, e.g. expired)
]]

now = clock_of(ARGV[1])
local holder, ran_for = ARGV[2], tonumber(ARGV[3])
local L, n, m, own = limits_of(3)
local freed, bell = KEYS[own + m], KEYS[own + m + 1]

-- A seat given back: its line, if tasks wait in it, is due now.
local function line_due(line)
  if redis.call('EXISTS', line) == 1 then
    redis.call('SADD', freed, line)
    redis.call('PEXPIRE', freed, 60000)
    ring(bell)
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
