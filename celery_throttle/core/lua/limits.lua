--- @include "core/learn.lua"
--[[
celery_throttle limits.lua: the limits a gate command is called with, laid out
one way for every command (core/gate.py, GateCalls, builds them):

KEYS[i]        limit i's key, i = 1..n: a rate bucket (bucket.lua), or a
               concurrency limit's sorted set of leases (lease.lua)
KEYS[n+1]      the prefix's epoch (epoch.lua)
KEYS[n+1+j]    the side key of the j-th limit among the n that has one, j = 1..s:
               a concurrency limit's meta hash (lease.lua), a learning rate
               limit's record (learn.lua)
KEYS[n+2+s..]  the command's own keys, named at its top

ARGV[1..HEAD]  the command's own head, named at its top; ARGV[1] is always now
               (clock.lua)
ARGV[HEAD+3i-2 .. HEAD+3i]  limit i:
               a rate limit: interval T (us >= 1), burst B (>= 1), cost c
               (1 <= c <= B, checked by the caller; settle.lua and follow.lua
               give it a meaning of their own, said there); a rate limit that
               learns its provider's quota has "T/F" for T: its ceiling's and
               its floor's intervals, and decides at its learned interval
               a concurrency limit: 0, seats N (>= 1), lease (us >= 1)
]]

-- The limits after an ARGV head of `head` fields: L[i] is a rate limit
-- { key, interval, burst, cost } (one that learns: learn.lua's fields too)
-- or a concurrency limit { key, concurrent, seats, lease, meta, nth };
-- returns L, n, m (the concurrency limits among the n) and the index in
-- KEYS of the command's first own key.
local function limits_of(head)
  local n = (#ARGV - head) / 3
  local L, m, s = {}, 0, 0
  for i = 1, n do
    local base = head + 3 * i
    local field = ARGV[base - 2]
    local interval = tonumber(field)
    if interval == 0 then
      m, s = m + 1, s + 1
      L[i] = { key = KEYS[i], concurrent = true, seats = tonumber(ARGV[base - 1]),
               lease = tonumber(ARGV[base]), meta = KEYS[n + 1 + s], nth = m }
    else
      L[i] = { key = KEYS[i], interval = interval, burst = tonumber(ARGV[base - 1]),
               cost = tonumber(ARGV[base]) }
      if not interval then
        local ceiling, floor = learning_of(field)
        s = s + 1
        learns(L[i], ceiling, floor, KEYS[n + 1 + s])
      end
    end
  end
  return L, n, m, n + 2 + s
end

-- Is limit i (1-based) in the booked-limits mask `mask` (bit i-1)?
local function booked_in(mask, i)
  return math.floor(mask / 2 ^ (i - 1)) % 2 == 1
end
