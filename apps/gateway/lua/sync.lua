-- SYNC: the pool as the caller's snapshot describes it (capacity, saturation, reservations, timeouts); more
-- room starts waiters (AdmissionLedger.set_capacity / set_saturation).
-- ARGV: now, capacity, KV capacity, saturation, wait timeout, max evictions, reservation signature, pairs.
local now = clock(ARGV[1])
local reserved = {}
for i = 8, #ARGV do table.insert(reserved, ARGV[i]) end
local pool = pool_config(now, ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], reserved)
pool.res_sig = tonumber(ARGV[7])
local started = drain(pool, now)
took_room(pool)
save()
publish('s', started)
return started
