-- SLOT: take (or renew) a slot of the pool's shared dispatch budget. KEYS: slots, budget.
-- ARGV: request id, lease seconds, capacity.
return take_slot(KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), clock(''))
