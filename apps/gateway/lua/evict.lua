-- EVICT: terminate a running request (preemption), refund its output, start waiters (AdmissionLedger.evict).
-- ARGV: now, request id.
local now = clock(ARGV[1])
local r = request(ARGV[2])
if r == nil or r.state ~= 'running' then return {'unknown', {}, '0'} end
local pool = load(POOL)
local refund = evict_one(pool, r, now)
local started = drain(pool, now)
if #started > 0 then took_room(pool) end
save()
publish('e', {ARGV[2]})
publish('s', started)
return {'evicted', started, fmt(refund)}
