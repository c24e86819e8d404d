-- SYNC: the pool as the caller's snapshot describes it (capacity, saturation, reservations, timeouts) and the
-- limits its entitlements' queues go by (bound or not, concurrency, KV bytes: as COMMIT stores them, for the
-- entitlements the store knows); more room starts waiters and queue heads (AdmissionLedger.set_capacity,
-- set_saturation, upsert_entitlement).
-- ARGV: now, capacity, KV capacity, saturation, wait timeout, max evictions, reservation signature, the number of
-- reservation arguments, the reservations as pairs, then per entitlement: id, queue limits, bound (1/0).
local now = clock(ARGV[1])
local count = tonumber(ARGV[8])
local reserved = {}
for i = 9, 8 + count do table.insert(reserved, ARGV[i]) end
local pool = pool_config(now, ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], reserved)
pool.res_sig = tonumber(ARGV[7])
local listed = {}
for i = 9 + count, #ARGV, 3 do listed[ARGV[i]] = true end
-- An entitlement gone from the pool (deleted, moved) is no longer bound: nothing leaves its queue (its waiters
-- expire), as the in-process store marks it expired.
for _, ent in ipairs(redis.call('ZRANGE', QENTS, 0, -1)) do
  if not listed[ent] then
    local e = load(ent_key(ent))
    if field(e, 'bound') ~= 0 then
      e.bound = 0
      touch(e)
    end
  end
end
for i = 9 + count, #ARGV, 3 do
  local e = load(ent_key(ARGV[i]))
  if not e._new then
    local conc, bconc, kvl, bkvl, mb = string.match(ARGV[i + 1], '^(%S+) (%S+) (%S+) (%S+) (%S+) %S+$')
    e.conc, e.bconc, e.kvl, e.bkvl, e.mb = tonumber(conc), tonumber(bconc), num(kvl), num(bkvl), tonumber(mb)
    e.bound = tonumber(ARGV[i + 2])
    touch(e)
  end
end
local started = drain(pool, now)
took_room(pool)
save()
publish('s', started)
return started
