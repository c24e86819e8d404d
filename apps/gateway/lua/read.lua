-- READ (no writes): the snapshot `apps.policy.admit` decides on (in Python): the entitlement's levels, bucket and EWMA
-- state, the pool's levels, idle reservations, admission threshold and lowest evictable priority, and the
-- pool's version, which COMMIT compares (compare-and-set), the length of the entitlement's queue and the start
-- of its oldest running request, the pool's dispatch budget ('' when none), and whether the offered request's id is
-- in flight already (1/0: a duplicate, refused before any check as AdmissionLedger.request refuses it).
-- ARGV: now ('' = Redis time), entitlement id, bucket capacity (-1 = unlimited), bucket rate, the offered request's
--       id ('' = none), then the pool's reservations as pairs: id, "concurrency kv_bytes".
local now = clock(ARGV[1])
local reserved = {}
for i = 6, #ARGV do table.insert(reserved, ARGV[i]) end
-- Nothing is written: the refill and the limits seen here are applied for real by COMMIT (a refill is the same
-- in one step or two), so concurrent readers never disturb each other.
-- One string of space-separated fields (a reply of one element: parsing each element of a list is what a
-- client pays for), every number exact; the two priorities are empty when there is none.
return table.concat((snapshot(ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5], reserved, now)), ' ')
