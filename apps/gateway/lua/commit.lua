-- COMMIT: apply the decision `apps.policy.admit` took on READ's snapshot, if the pool's version is still the
-- one read (else {0}: the caller reads again). The request is charged (bucket, in flight, KV) and either
-- starts or waits; a waiting one may evict lower-priority preemptible work (AdmissionLedger.request). A queued
-- one joins its entitlement's queue charged nothing (AdmissionLedger._enqueue).
-- A decision taken on a snapshot the caller kept from an earlier reply (no READ: one call, not two) comes with
-- that snapshot's fingerprint, and stands only if the snapshot READ would give now has the same and the
-- bucket still holds the charge: then the decision is the one READ's snapshot would have given. Else the
-- reply is {0, READ's snapshot now}, and the caller decides again on it.
-- KEYS: pool prefix.
-- ARGV: now, version, request id, entitlement id, 'running'|'waiting'|'queued', priority, token cost, KV bytes,
--       input tokens, max tokens, evictable (1/0), evict (1/0), bucket capacity, bucket rate, pool capacity,
--       KV capacity, saturation, wait timeout, max evictions, lease seconds, the fingerprint of the snapshot the
--       decision was taken on ('' = checked by the pool's version), its change mark ('' = none), reservation
--       signature, the entitlement's queue limits ("concurrency burst_concurrency kv_bytes burst_kv_bytes
--       may_burst queue_wait_s", -1 when unlimited), whether to answer with the entitlement's snapshot after it
--       ('1': another offer of it waits in the caller's process, and decides on that; '' otherwise: computing
--       it is work no one waits for), the snapshot's debt, burst and whether the class is reserved ("debt burst
--       1|0", debt '-' for a class without one) when the decision is a start within the entitlement's own
--       limits that borrows nothing ('' otherwise), then the reservations as pairs (only read when the
--       signature changed, or to check a snapshot).
-- A start decided on a snapshot whose mark no longer stands still stands when `admit` would take the same
-- decision now (`still_admitted`): concurrent offers of one process each decide on the snapshot they kept and
-- need not wait for each other's replies.
-- A kept snapshot whose change mark still stands is not read again: no write since means READ would give the
-- same (machine.lua's `new_mark`); only the bucket and the duplicate flag are checked.
-- Reply: {1, state, started, evicted, in flight, bucket level, how a kept snapshot was confirmed (1: its mark
-- stood, 2: `still_admitted`, 0: its fingerprint, or READ's snapshot),
-- the entitlement's snapshot after it when asked ('' otherwise)}, or {0} / {0, READ's snapshot now}.
local now = clock(ARGV[1])
local pool = load(POOL)
-- The entitlement's snapshot after this commit, for the caller's next offer of it (asked for), as RELEASE gives it.
local function after(ent, at)
  if ARGV[25] ~= '1' then return '' end
  return snapshot_after(ent, at)
end
-- The reservations as given, read only when needed (a kept snapshot to check, or a new signature).
local function given_pairs()
  local given = {}
  for i = 27, #ARGV do table.insert(given, ARGV[i]) end
  return given
end
local shortcut = 0
-- The entitlement's limits as its queue goes by them (also what `still_admitted` checks).
local conc, bconc, kvl, bkvl, mb, qwait = string.match(ARGV[24], '^(%S+) (%S+) (%S+) (%S+) (%S+) (%S+)$')
-- Whether `admit` (apps/policy/admission.py) takes now the decision the caller took on its snapshot: a start
-- within the entitlement's own limits that borrows nothing. Its path to that decision, written out: the same
-- debt (where the class has one) and burst (the priority), no queue (the request would join it), the request
-- not a duplicate, within the concurrency, the bucket and the KV limit, and room in the pool (free slots and KV
-- bytes as admit counts them: physical, and for a class that is not evictable what others' idle reservations
-- leave, its own reservation claimable), not saturated unless reserved. Every condition is one admit checks on
-- the same numbers, so the decision is the one READ's snapshot would give; anything else goes to the
-- fingerprint (tests/gateway/test_redis_still_admitted.py checks both ways against admit).
local function still_admitted(p, pairs_of)
  local e = entitlement(ARGV[4], now)
  bucket_limits(e, tonumber(ARGV[13]), tonumber(ARGV[14]), now)
  local debt, burst, reserved = string.match(ARGV[26], '^(%S+) (%S+) (%S+)$')
  if (debt ~= '-' and fmt(e.debt) ~= debt) or fmt(e.burst) ~= burst or field(e, 'qlen') ~= 0 then return false end
  if in_flight_already(ARGV[3]) then return false end
  local concurrency, kv_limit = tonumber(conc), tonumber(kvl)
  local cost, kv = tonumber(ARGV[7]), tonumber(ARGV[8])
  if (concurrency >= 0 and e.in_flight >= concurrency) or bucket_level(e, now) < cost then return false end
  if kv_limit >= 0 and kv > 0 and e.kv_in_flight + kv > kv_limit then return false end
  local cap = tonumber(ARGV[15])
  if p.budget ~= nil and p.budget >= 0 and p.budget < cap then cap = p.budget end
  local slots = cap - field(p, 'running')
  local free_kv = tonumber(ARGV[16]) - field(p, 'kv')
  local free_slots = slots
  if ARGV[11] ~= '1' then
    local own_slots, own_kv = 0, 0
    if reserved == '1' then
      if concurrency >= 0 and e.running < concurrency then own_slots = concurrency - e.running end
      if kv_limit >= 0 and e.kv_running < kv_limit then own_kv = kv_limit - e.kv_running end
    end
    local idle_slots, idle_kv = idle_reservations(pairs_of(), '')
    local reach_slots, reach_kv = slots + field(p, 'ev_n'), free_kv + field(p, 'ev_kv')
    local entitled_slots = reach_slots - (idle_slots - own_slots)
    local entitled_kv = reach_kv - (idle_kv - own_kv)
    if own_slots > 0 then entitled_slots = math.max(entitled_slots, math.min(own_slots, reach_slots)) end
    if own_kv > 0 then entitled_kv = math.max(entitled_kv, math.min(own_kv, reach_kv)) end
    if entitled_slots < free_slots then free_slots = entitled_slots end
    if entitled_kv < free_kv then free_kv = entitled_kv end
  end
  if free_slots <= 0 or free_kv < kv then return false end
  return reserved == '1' or tonumber(ARGV[17]) < 1.0
end
if ARGV[21] ~= '' and ARGV[22] ~= '' and redis.call('GET', MARK) == ARGV[22] and pool.res_sig == tonumber(ARGV[23]) then
  -- Nothing written to the pool since the kept snapshot, and the reservations it was read with: READ would
  -- give it again, but for what changes without a write (the bucket's level) and the duplicate flag.
  local e = entitlement(ARGV[4], now)
  bucket_limits(e, tonumber(ARGV[13]), tonumber(ARGV[14]), now)
  if in_flight_already(ARGV[3]) or bucket_level(e, now) < tonumber(ARGV[7]) then
    local fields = snapshot(ARGV[4], tonumber(ARGV[13]), tonumber(ARGV[14]), ARGV[3], given_pairs(), now)
    return {0, table.concat(fields, ' ')}
  end
  shortcut = 1
elseif ARGV[21] ~= '' and ARGV[26] ~= '' and still_admitted(pool, given_pairs) then
  shortcut = 2
elseif ARGV[21] ~= '' then
  local fields, level = snapshot(ARGV[4], tonumber(ARGV[13]), tonumber(ARGV[14]), ARGV[3], given_pairs(), now)
  if fingerprint(fields) ~= ARGV[21] or fields[20] == '1' or level < tonumber(ARGV[7]) then
    return {0, table.concat(fields, ' ')}
  end
elseif field(pool, 'ver') ~= tonumber(ARGV[2]) then
  return {0}
end
local reserved = nil
if pool.res_sig ~= tonumber(ARGV[23]) then reserved = given_pairs() end
pool = pool_config(now, ARGV[15], ARGV[16], ARGV[17], ARGV[18], ARGV[19], reserved)
pool.res_sig = tonumber(ARGV[23])
local id = ARGV[3]
local e = entitlement(ARGV[4], now)
bucket_limits(e, tonumber(ARGV[13]), tonumber(ARGV[14]), now)
e.conc, e.bconc, e.kvl, e.bkvl, e.mb, e.bound = tonumber(conc), tonumber(bconc), num(kvl), num(bkvl), tonumber(mb), 1
pool.seq = pool.seq + 1
local r = load(req_key(id))
r._id, r._new = id, false
r.ent, r.prio, r.cost, r.kv, r.input, r.max = ARGV[4], tonumber(ARGV[6]), tonumber(ARGV[7]), num(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
r.ev, r.state, r.enq, r.seq = tonumber(ARGV[11]), '', now, pool.seq
touch(r)
touch(e)
redis.call('ZADD', LEASES, now + tonumber(ARGV[20]), id)
local started, evicted = {}, {}
if ARGV[5] == 'queued' then
  r.state, r.own = 'waiting', 1
  r.wm = wait_member(r.seq, id)
  r.dl = now + tonumber(qwait)
  pool.queued = field(pool, 'queued') + 1
  e.qlen = field(e, 'qlen') + 1
  redis.call('ZADD', queue_key(r.ent), r.seq, id)
  if not redis.call('ZSCORE', QENTS, r.ent) then redis.call('ZADD', QENTS, r.seq, r.ent) end
  redis.call('ZADD', WAIT_T, fmt(r.dl), r.wm)
  took_room(pool)
  save()
  return {1, 'waiting', {}, {}, e.in_flight, fmt(bucket_level(e, now)), shortcut, after(r.ent, now)}
end
charge(e, r, now)
if ARGV[5] == 'running' then
  start(pool, r, now)
  started = {id}
else
  r.state = 'waiting'
  pool.waiting = pool.waiting + 1
  r.wm = wait_member(r.seq, id)
  redis.call('ZADD', WAIT, fmt(-r.prio), r.wm)
  r.dl = now + pool.timeout
  redis.call('ZADD', WAIT_T, fmt(r.dl), r.wm)
  if ARGV[12] == '1' then evicted, started = evict_for(pool, r, now) end
  for _, other in ipairs(drain(pool, now)) do table.insert(started, other) end
end
took_room(pool)
local state = r.state
save()
publish('e', evicted)
-- Others' starts only: this one's caller learns its own from the reply.
local others = {}
for _, other in ipairs(started) do if other ~= id then table.insert(others, other) end end
publish('s', others)
return {1, state, started, evicted, e.in_flight, fmt(bucket_level(e, now)), shortcut, after(r.ent, now)}
