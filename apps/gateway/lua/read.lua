-- READ (no writes): the snapshot `apps.policy.admit` decides on (in Python): the entitlement's levels, bucket and EWMA
-- state, the pool's levels, idle reservations, admission threshold and lowest evictable priority, and the
-- pool's version, which COMMIT compares (compare-and-set), the length of the entitlement's queue and the start
-- of its oldest running request, the pool's dispatch budget ('' when none), and whether the offered request's id is
-- in flight already (1/0: a duplicate, refused before any check as AdmissionLedger.request refuses it).
-- ARGV: now ('' = Redis time), entitlement id, bucket capacity (-1 = unlimited), bucket rate, the offered request's
--       id ('' = none), then the pool's reservations as pairs: id, "concurrency kv_bytes".
local now = clock(ARGV[1])
local e = entitlement(ARGV[2], now)
bucket_limits(e, tonumber(ARGV[3]), tonumber(ARGV[4]), now)
local level = bucket_level(e, now)
local pool = load(POOL)
local reserved = {}
for i = 6, #ARGV do table.insert(reserved, ARGV[i]) end
local idle_slots, idle_kv = idle_reservations(reserved, '')
local low = redis.call('ZRANGE', PRIO, 0, 0, 'WITHSCORES')
local low_evict = redis.call('ZRANGE', EVICT, 0, 0, 'WITHSCORES')
-- The oldest start only matters to a refusal by its own limits (Retry-After): read when they are reached.
local oldest = {}
if (limit(e, 'conc') >= 0 and e.in_flight >= e.conc) or (limit(e, 'kvl') >= 0 and e.kv_in_flight > 0) then
  oldest = redis.call('ZRANGE', run_key(ARGV[2]), 0, 0, 'WITHSCORES')
end
-- An evicted request's record waits for its late release: it is no longer in flight.
local held = ARGV[5] ~= '' and request(ARGV[5]) or nil
local duplicate = (held ~= nil and held.state ~= 'evicted') and '1' or '0'
-- Nothing is written: the refill and the limits seen here are applied for real by COMMIT (a refill is the same
-- in one step or two), so concurrent readers never disturb each other.
-- One string of space-separated fields (a reply of one element: parsing each element of a list is what a
-- client pays for), every number exact; the two priorities are empty when there is none.
return table.concat({fmt(e.in_flight), fmt(e.kv_in_flight), fmt(e.running), fmt(e.kv_running), fmt(level),
                     fmt(e.debt), fmt(e.burst), fmt(field(pool, 'running')), fmt(field(pool, 'kv')),
                     fmt(idle_slots), fmt(idle_kv), low[2] or '', low_evict[2] or '', fmt(field(pool, 'ev_n')),
                     fmt(field(pool, 'ev_kv')), fmt(field(pool, 'ver')),
                     fmt(field(e, 'qlen')), oldest[2] or '', fmt(pool.budget or -1), duplicate}, ' ')
