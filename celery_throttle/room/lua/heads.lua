--- @include "room/lines.lua"
--[[
celery_throttle heads.lua: the first waiting tasks of the given lines (read
only; see room/lines.py).  A task's record is in the messages hash, before
its message (record.lua).

KEYS[1]   the messages hash
KEYS[2..] the lines
ARGV[1]   how many per line

Reply: { line count, entry 1, its record's JSON, entry 2, ... } per line, in
order
]]

local out = {}
for j = 2, #KEYS do
  local entries = redis.call('ZRANGE', KEYS[j], 0, tonumber(ARGV[1]) - 1)
  out[#out + 1] = #entries
  for _, e in ipairs(entries) do
    out[#out + 1] = e
    out[#out + 1] = record_of(KEYS[1], e) or ''
  end
end
return out
