--[[
celery_throttle record.lua: what the messages hash holds for an entry, one
copy for the scripts that read it, which include it.

A parked task's value is its envelope (envelope.py).  A task waiting in a
limit's line stores one record instead (envelope.py's in_line): the byte 2,
what the dispatch needs of it (JSON, which never holds a raw newline), a
newline, its envelope.
]]

-- The record's JSON (nil for a plain envelope) and the envelope.
local function split_record(stored)
  if string.byte(stored, 1) == 2 then
    local nl = string.find(stored, '\n', 2, true)
    if nl then
      return string.sub(stored, 2, nl - 1), string.sub(stored, nl + 1)
    end
  end
  return nil, stored
end
