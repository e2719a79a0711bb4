--- @include "core/clock.lua"
-- Which copy of an acks_late task's message may go on (see integration/copies.py).
--
-- KEYS[1]  the task's pointer ({prefix}:copy:<id digest>:<retries>); absent until
--          the user's message ("-") first moves it, and again after the store
--          lost its data (a restart without persistence, a flush) or the pointer
--          outlived its TTL
-- ARGV[1]  this copy's id ("-" for the user's message)
-- ARGV[2]  the copy that published this one ("" for the user's message)
-- ARGV[3]  what the pointer becomes if this copy may go on:
--          "ran:" .. ARGV[1] when it starts, "done:" .. ARGV[1] when its run ends,
--          the successor's id when it is re-published; empty: only ask (nothing
--          moves), before a copy acts on what a newer copy may hold
-- ARGV[4]  pointer TTL (ms)
-- ARGV[5]  the latest this copy may start, server clock (us; 0 or absent: any
--          time): a copy admitted for a start it was charged for is checked
--          here, in the last store call before it starts, so that a store
--          slow to answer cannot let it start later than its grace
-- ARGV[6]  "1": this delivery may not run a copy that started already (the
--          task acknowledges early, or the broker did not flag this delivery as
--          its redelivery of an acks_late message a crash cut off): a start the
--          pointer already records for this copy is another delivery of the
--          same message (the delay ladder's at-least-once, a publish taken
--          twice), refused as "running"
--
-- A copy may go on if the pointer names it, or names it as started (its own
-- redelivery after a crash mid-run: acks_late's at-least-once; not with
-- ARGV[6]), or names the
-- copy that published it, plain or started but not done (the pointer could
-- not be moved: store down, or a crash between the publish and the move).
-- Whichever of two such copies starts or moves on first takes the pointer,
-- and the other is refused.  "done:" refuses every copy: the task ran.
-- An absent pointer lets any copy go on and take it: past the user's first
-- message only a store that lost its data has no pointer, and then nothing
-- tells a stale copy from the one that carries the task (a copy
-- re-published while the store was down names a predecessor the empty store
-- never heard of): running it beats losing it, as in arrive.lua.
-- Returns 1 if this copy may go on; 5 if it is asked, or starts, as a run again
-- of a copy that started (its redelivery: the start it carries was spent by the
-- run the crash cut off); 3 if it is past ARGV[5] (nothing moved);
-- else 2 if another copy of the task has started and not ended (the
-- concurrency seats held under the task's id are that copy's), 4 if the
-- task's run has ended (no other copy holds seats under its id), else 0: the
-- pointer names a newer copy, which may hold seats under the task's id (a
-- copy served from its line is given its seat at dispatch, on its way).
local latest = tonumber(ARGV[5] or 0) or 0
if latest > 0 then
  if server_us() > latest then
    return 3
  end
end
local current = redis.call('GET', KEYS[1])
local mine, prev = ARGV[1], ARGV[2]
local rerun = current == 'ran:' .. mine and ARGV[6] ~= '1'
if not current or current == mine or rerun
    or (prev ~= '' and (current == prev or current == 'ran:' .. prev)) then
  if ARGV[3] ~= '' then
    redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
  end
  if rerun and (ARGV[3] == '' or ARGV[3] == current) then
    return 5  -- (asked, or starting: not the run itself moving on, re-published or done)
  end
  return 1
end
if string.sub(current, 1, 4) == 'ran:' then
  return 2
end
if string.sub(current, 1, 5) == 'done:' then
  return 4
end
return 0
