--[[
celery_throttle turns.lua: the turns of a fair line, one copy for the
scripts that put a task in one (enqueue.lua, and serve.lua when a task moves
to another of its limits' lines), which include it.

A fair line serves the values of its tasks' fair key in turn (weighted
fair queuing by finish tags): a task of value g gets the tag
max(V, last tag of g) + cost / weight of g, where V is the tag of the task
served last; the line is ordered by tag.  So a value that floods the line
takes its turns one after another far ahead, and a value that arrives later
starts at V: its tasks alternate with the flood's from the next turn.
The turns hash: '~' -> V, g -> the last tag given to value g.
]]

local function fair_tag(turns, group, units)
  local v = tonumber(redis.call('HGET', turns, '~') or 0)
  local last = tonumber(redis.call('HGET', turns, group) or 0)
  local tag = math.max(v, last) + units
  redis.call('HSET', turns, group, string.format('%.17g', tag))
  return tag
end
