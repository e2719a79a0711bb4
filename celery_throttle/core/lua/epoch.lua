--[[
celery_throttle epoch.lua: the prefix's epoch, one copy for every script that
hands it out (decide.lua with a booking, room/lua/dispatch.lua, serve.lua and withdraw.lua
with a dispatched task), which include it.

The epoch is when the prefix's state began: set once, with no TTL, when first
needed.  A Redis restart without persistence or a flush loses it, and the
next one differs: a booking or a dispatched copy carrying an older epoch is
known to come from state the store no longer has.
]]

-- The epoch (us, as a string), set to `now` if there is none.
local function epoch_of(key, at)
  local e = redis.call('GET', key)
  if not e then
    e = string.format('%d', at)
    redis.call('SET', key, e)
  end
  return e
end
