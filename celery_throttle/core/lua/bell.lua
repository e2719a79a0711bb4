--[[
celery_throttle bell.lua: the dispatchers' doorbell, one copy for every script
that rings it (a seat given back, release.lua; a task parked or put in line
that is the new earliest, or revoked tasks made due, in the waiting room).

The bell is a list holding at most one token: any dispatcher may dispatch any
entry, and the one woken goes back to sleep until the next time it reads.
]]

local function ring(bell)
  redis.call('LPUSH', bell, '1')
  redis.call('LTRIM', bell, 0, 0)
  redis.call('PEXPIRE', bell, 60000)
end
