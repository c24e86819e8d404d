-- EXPIRE: requests whose wait reached its deadline are turned away (the pool's acquire timeout for the waiting
-- room, the entitlement's queue wait for its queue), earliest deadline first; a waiting one's charge is refunded,
-- and both count as unmet demand; then the queues whose entitlements have room now go (a bucket refilled):
-- AdmissionLedger.wake.  ARGV: now.  Returns the ids expired and the ids started.
local now = clock(ARGV[1])
local pool = load(POOL)
if pool._new then return {{}, {}} end
local expired = {}
while true do
  local head = redis.call('ZRANGE', WAIT_T, 0, 0, 'WITHSCORES')
  if #head == 0 or tonumber(head[2]) > now then break end
  local r = request(string.sub(head[1], 17))
  if r == nil or r.state ~= 'waiting' then
    redis.call('ZREM', WAIT_T, head[1])
  else
    local e = load(ent_key(r.ent))
    if r.own == 1 then leave_queue(pool, r) else finish_waiting(pool, r, now) end
    count_refusal(e, r.cost, r.kv)
    table.insert(expired, r._id)
  end
end
local started = drain(pool, now)
if #started > 0 then took_room(pool) end
save()
publish('x', expired)
publish('s', started)
return {expired, started}
