--- @include "core/clock.lua"
--- @include "core/limits.lua"
--- @include "core/lease.lua"
--[[
celery_throttle resume.lua: end a pause of the limits given now (an operator's
`celery throttle resume`; pause.lua).

KEYS and the limits' ARGV: limits.lua.
ARGV[1]  now (clock.lua)

Reply: the limits that were paused
]]

now = clock_of(ARGV[1])
local L, n = limits_of(1)
local count = 0
for i = 1, n do
  local lim = L[i]
  if lim.concurrent then
    if meta_num(lim, 'pause') > now then
      count = count + 1
    end
    redis.call('HDEL', lim.meta, 'pause')
  else
    local tat, paused, shift = read_rate(lim.key)
    if paused > now then
      count = count + 1
      write_rate(lim.key, math.max(tat, now), 0, shift)
    end
  end
end
return count
