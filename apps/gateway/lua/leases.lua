-- LEASES: renew this process's requests (ARGV: 'renew', now, lease seconds, ids...), or release those whose
-- lease ran out because their process died (ARGV: 'reap', now): a waiting one is cancelled, a running one
-- completes with its usage unknown (nothing refunded), as AdmissionLedger.release does with no counts.
local now = clock(ARGV[2])
if ARGV[1] == 'renew' then
  local deadline = now + tonumber(ARGV[3])
  for i = 4, #ARGV do redis.call('ZADD', LEASES, 'XX', fmt(deadline), ARGV[i]) end
  return {}
end
local pool = load(POOL)
local reaped = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', LEASES, '-inf', fmt(now), 'LIMIT', 0, 100)) do
  redis.call('ZREM', LEASES, id)
  local r = request(id)
  if r ~= nil then
    if r.own == 1 then
      leave_queue(pool, r)
    elseif r.state == 'waiting' then
      finish_waiting(pool, r, now)
    else
      local e = load(ent_key(r.ent))
      stop(pool, r, now)
      e.tok = e.tok + r.cost
      e.done = e.done + 1
      touch(e)
    end
    table.insert(reaped, id)
  end
end
local started = {}
if #reaped > 0 then
  started = drain(pool, now)
  if #started > 0 then took_room(pool) end
end
save()
publish('s', started)
return reaped
