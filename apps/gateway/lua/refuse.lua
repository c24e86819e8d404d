-- REFUSE: a request the checks turned away for lack of capacity is unmet demand for the next tick
-- (AdmissionLedger._rejected).  ARGV: now, entitlement id, token cost, KV bytes.
local now = clock(ARGV[1])
local e = entitlement(ARGV[2], now)
count_refusal(e, tonumber(ARGV[3]), num(ARGV[4]))
save()
return 1
