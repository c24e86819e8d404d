-- TICK: close the pool's served/demand window (AdmissionLedger.tick_readings): the integrals up to now of every
-- entitlement not at rest (the `unsettled` set: one at rest has nothing to close), returned and reset; Python
-- turns them into debt and burst with the same `apps.policy.window.window_reading` and writes them back
-- (DYNAMICS). A window shorter than 1 us stays open.
-- ARGV: now.  Returns {0} or {1, elapsed, id, 11 figures..., id, ...}.
local now = clock(ARGV[1])
local pool = load(POOL)
if pool._new then return {0} end
local elapsed = now - pool.last_tick
if elapsed < 1e-6 then return {0} end
local out = {1, fmt(elapsed)}
for _, id in ipairs(redis.call('SMEMBERS', UNSETTLED)) do
  local e = load(ent_key(id))
  if e._new then
    redis.call('SREM', UNSETTLED, id)  -- its record is gone
  else
    accumulate(e, now)
    for _, value in ipairs({id, fmt(e.slot_s), fmt(e.kv_s), fmt(e.wait_s), fmt(e.tok), fmt(e.done),
                            fmt(e.rej_n), fmt(e.rej_tok), fmt(e.rej_kv), fmt(e.debt), fmt(e.burst)}) do
      table.insert(out, value)
    end
    e.slot_s, e.kv_s, e.wait_s, e.tok, e.done, e.rej_n, e.rej_tok, e.rej_kv = 0, 0, 0, 0, 0, 0, 0, 0
    touch(e)
  end
end
pool.last_tick = now
touch(pool)
save()
return out
