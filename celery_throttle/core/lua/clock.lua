--[[
celery_throttle clock.lua: the clock of every script, which include it.  It
declares `now` (microseconds), which a script sets before it calls anything
that reads it.

Every gate command's ARGV[1] is "now" in microseconds: 0 means this server's
TIME (the default: every worker agrees whatever its own clock says),
anything else the caller's clock (a gate built with clock="local" or a
callable).  The waiting room's scripts are on the server's clock.
]]
local now

-- This server's clock, microseconds.
local function server_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- The clock a command decides on: the caller's `given` (us), else the server's.
local function clock_of(given)
  local at = tonumber(given)
  if at <= 0 then
    return server_us()
  end
  return at
end
