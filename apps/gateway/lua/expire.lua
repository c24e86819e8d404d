-- EXPIRE: waiting requests that waited the acquire timeout are turned away, oldest first; their charge is
-- refunded and they count as unmet demand (AdmissionLedger.expire_waiting).  ARGV: now.
local now = clock(ARGV[1])
local pool = load(POOL)
if pool._new then return {} end
local expired = {}
while true do
  local head = redis.call('ZRANGE', WAIT_T, 0, 0)
  if #head == 0 then break end
  local r = request(string.sub(head[1], 17))
  if r == nil or r.state ~= 'waiting' then
    redis.call('ZREM', WAIT_T, head[1])
  else
    if now - r.enq < pool.timeout then break end
    local e = load(ent_key(r.ent))
    finish_waiting(pool, r, now)
    count_refusal(e, r.cost, r.kv)
    table.insert(expired, r._id)
  end
end
save()
publish('x', expired)
return expired
