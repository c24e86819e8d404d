-- TICK: close the pool's served/demand window (AdmissionLedger.tick_readings): every entitlement's
-- integrals up to now, returned and reset; Python turns them into debt and burst with the same
-- `apps.policy.window.window_reading` and writes them back (DYNAMICS). A window shorter than 1 us stays open.
-- ARGV: now, entitlement ids.  Returns {0} or {1, elapsed, id, 11 figures..., id, ...}.
local now = clock(ARGV[1])
local pool = load(POOL)
if pool._new then return {0} end
local elapsed = now - pool.last_tick
if elapsed < 1e-6 then return {0} end
local out = {1, fmt(elapsed)}
for i = 2, #ARGV do
  local e = entitlement(ARGV[i], now)
  accumulate(e, now)
  for _, value in ipairs({ARGV[i], fmt(e.slot_s), fmt(e.kv_s), fmt(e.wait_s), fmt(e.tok), fmt(e.done),
                          fmt(e.rej_n), fmt(e.rej_tok), fmt(e.rej_kv), fmt(e.debt), fmt(e.burst)}) do
    table.insert(out, value)
  end
  e.slot_s, e.kv_s, e.wait_s, e.tok, e.done, e.rej_n, e.rej_tok, e.rej_kv = 0, 0, 0, 0, 0, 0, 0, 0
  touch(e)
end
pool.last_tick = now
touch(pool)
save()
return out
