--- @include "core/clock.lua"
--- @include "core/limits.lua"
--- @include "core/bucket.lua"
--- @include "core/lease.lua"
--[[
celery_throttle inspect.lua: read one limit, writing nothing (status commands,
metrics).  "When is the next start free" is bucket.lua's admission test, the
one a decision makes.

KEYS and the limit's ARGV: limits.lua, one limit.  The command's own:
KEYS[c]  a rate limit's hold note (follow.lua); absent for a concurrency limit
ARGV[1]  now (clock.lua)

Reply: a rate limit: { exists, tat_ahead_us, next_free_us, pttl_ms, now,
         paused_us, held_us, held_remaining (-1: not held), held_at_us,
         learned_interval_us (0: it does not learn), last move ("cut",
         "raise" or ""), its time (us), the rate before it (a string) }
       a concurrency limit: { held, paused_us, average_run_us, now }
]]

now = clock_of(ARGV[1])
local L, _, _, own = limits_of(1)
local lim = L[1]
if lim.concurrent then
  local held = redis.call('ZCOUNT', lim.key, '(' .. us(now), '+inf')
  local paused = math.max(0, meta_num(lim, 'pause') - now)
  return { held, paused, meta_num(lim, 'run'), now }
end
local tat, paused, _, exists = read_rate(lim.key)
tat = math.max(tat, now)
local left, reset, at = -1, now, 0
local note = KEYS[own] and redis.call('GET', KEYS[own])
if note then
  local a, b, c = string.match(note, '^(%d+) (%d+) (%d+)$')
  if a and tonumber(b) > now then
    left, reset, at = tonumber(a), tonumber(b), tonumber(c)
  end
end
local learned, why, moved, before = 0, '', 0, ''
if lim.learned then
  local f = redis.call('HMGET', lim.learned, 'why', 'at', 'from')
  learned, why, moved, before = lim.interval, f[1] or '', tonumber(f[2]) or 0, f[3] or ''
end
return { exists and 1 or 0, tat - now, math.max(0, rate_wait(lim, tat, paused)),
         redis.call('PTTL', lim.key), now, math.max(0, paused - now), reset - now, left, at,
         learned, why, moved, before }
