-- BUDGET: the pool's dispatch budget (seed 002's AIMD; '' removes it): no more than this many requests run. A
-- smaller one cancels nothing (new starts wait for releases), a larger one starts waiters (AdmissionLedger.set_budget).
-- ARGV: now, budget.  Returns the ids started.
local now = clock(ARGV[1])
local pool = pool_record(now)
if ARGV[2] == '' then pool.budget = -1 else pool.budget = tonumber(ARGV[2]) end
local started = drain(pool, now)
took_room(pool)
save()
publish('s', started)
return started
