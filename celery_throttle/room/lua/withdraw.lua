--- @include "core/epoch.lua"
--- @include "core/bell.lua"
--- @include "room/lines.lua"
--[[
celery_throttle withdraw.lua: revoked tasks leave at once, wherever they wait
(room/parking.py's WaitingRoom.cancel found their entries).

KEYS[1]   messages hash   KEYS[2] claimed set    KEYS[3] epoch
KEYS[4]   parked set      KEYS[5] wake list (bell.lua)
KEYS[6..] the lines the entries in line wait in (each in one of them)
ARGV[1]   claim timeout, us (as serve.lua)
ARGV[2]   entries in line (space-separated): taken out of their line and
          dispatched without a charge (flag "x"), the worker drops them
ARGV[3]   parked entries (space-separated): due now (dispatch.lua claims
          them next), so their worker drops them now, not at their time

Reply: { parked entries made due, epoch, entry, token, flag, start, message,
       ... } (start 0)
]]

now = server_us()
local out = { 0, tonumber(epoch_of(KEYS[3], now)) }
local deadline = now + tonumber(ARGV[1])
for e in string.gmatch(ARGV[2], '%S+') do
  local taken = false
  for j = 6, #KEYS do
    taken = redis.call('ZREM', KEYS[j], e) == 1 or taken
  end
  if taken then
    hand_out(out, KEYS[1], KEYS[2], deadline, e, 'x', 0)
  end
end
for e in string.gmatch(ARGV[3], '%S+') do
  out[1] = out[1] + redis.call('ZADD', KEYS[4], 'XX', 'CH', now, e)
end
if out[1] > 0 then
  ring(KEYS[5])
end
return out
