-- The admission state machine of one pool, in Redis: the transitions of apps/policy/ledger.py, step for
-- step (Lua cannot import Python). `make conformance` runs one table of scenarios against the ledger, the
-- in-process store and this, expecting the same outcomes. apps/gateway/redis_state.py loads this library,
-- and every entry (one file each, a function's body) as one Redis function library, so
-- the library is compiled and set up once, not on every call; `bind` points it at the call's keys.
--
-- KEYS[1] is the pool's key prefix, `tp:gw:{<pool>}:` (one hash tag: a pool's keys share a cluster slot).
-- Records (one MessagePack map each, read and written whole: a Lua loop over hash fields, formatting and
-- parsing every number, cost more than the transitions themselves):
--   pool      levels and configuration of the pool (running, kv, ev_n, ev_kv, waiting, queued, seq, cap, kv_cap,
--             sat, timeout, max_ev, last_tick, ver, res_sig, budget: the dispatch budget of seed 002's AIMD, no
--             more than this many run whatever the capacity, absent or -1 when none; set by BUDGET,
--             AdmissionLedger.set_budget)
--   ent:<id>  one entitlement: in_flight, kv_in_flight, running, kv_running, its token bucket (bcap: -1 when
--             unlimited, brate, level, ts), debt, burst, and the served/demand window (last_change, slot_s,
--             kv_s, wait_s, tok, done, rej_n, rej_tok, rej_kv)
--   req:<id>  one queued, waiting or running request (ent, prio, cost, kv, input, max, ev, state, enq, seq, wm,
--             em, dl: its deadline while it waits, own: 1 while in its entitlement's queue)
--   ent:<id> also holds its queue's length (qlen) and the limits the queue is let go by (conc, bconc, kvl, bkvl:
--             -1 when unlimited; mb: may burst; bound), as the last COMMIT or SYNC was given them
-- Indexes:
--   prio      zset  running requests by priority (the admission threshold is the lowest)
--   evict     zset  running preemptible requests by priority; members sort newest dispatch first
--   wait      zset  waiting requests by -priority; members sort by arrival
--   wait_t    zset  waiting and queued requests by deadline (members as in wait)
--   q:<ent>   zset  an entitlement's queue (requests over its own limits, holding nothing) by arrival (seq)
--   qents     zset  entitlements whose queue holds requests, by the arrival of their head
--   run:<ent> zset  an entitlement's running requests by start time (Retry-After's earliest expected end)
--   res       hash  Bound dedicated/guaranteed entitlements of the pool: id -> "concurrency kv_bytes"
--   leases    zset  requests by lease deadline (a process that dies stops renewing them)
--   busy      set   entitlements with requests in flight
--   unsettled set   entitlements not at rest (`at_rest`): those a tick reads
--             (both kept by `save`; SYNC, which writes every entitlement of the pool, fills them for records an
--             earlier release wrote)
--   mark      string the pool's change mark, new with every save that writes (`new_mark`)
--   marks     string the counter in it
-- MessagePack keeps every double exactly; scores and replies are formatted with 17 significant digits.

local KEYS, ARGV, BASE, POOL, PRIO, EVICT, WAIT, WAIT_T, RES, LEASES, QENTS, BUSY, UNSETTLED, MARK, MARKS
local EVENTS = 'tp:gw:events'
-- Fields of a loaded record that are the cache's own, never stored.
local PRIVATE = {_key = true, _new = true, _id = true}
-- Records are read once per call into tables and written back by `save` (the records touched).
local cache, dirty, order

-- One call's keys and arguments, and a fresh record cache (Redis runs one call at a time).
local function bind(keys, args)
  KEYS, ARGV = keys, args
  BASE = keys[1]
  POOL, PRIO, EVICT, WAIT, WAIT_T = BASE .. 'pool', BASE .. 'prio', BASE .. 'evict', BASE .. 'wait', BASE .. 'wait_t'
  RES, LEASES, QENTS, BUSY = BASE .. 'res', BASE .. 'leases', BASE .. 'qents', BASE .. 'busy'
  UNSETTLED, MARK, MARKS = BASE .. 'unsettled', BASE .. 'mark', BASE .. 'marks'
  cache, dirty, order = {}, {}, {}
end

local function fmt(x)
  if x == math.huge then return 'inf' end
  if x == -math.huge then return '-inf' end
  return string.format('%.17g', x)
end

local function num(v)
  if v == nil or v == false or v == '' then return 0 end
  if v == 'inf' then return math.huge end
  if v == '-inf' then return -math.huge end
  return tonumber(v)
end

local function clock(arg)
  if arg ~= nil and arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- A record a release before MessagePack records wrote as a hash: read once, written back as a record by `save`.
local HASH_STRINGS = {ent = true, state = true, wm = true, em = true}
local function from_hash(key)
  local t, flat = {}, redis.call('HGETALL', key)
  for i = 1, #flat, 2 do
    if HASH_STRINGS[flat[i]] then t[flat[i]] = flat[i + 1] else t[flat[i]] = num(flat[i + 1]) end
  end
  return t, #flat > 0
end

local function load(key)
  local t = cache[key]
  if t == nil then
    local found
    local raw = redis.pcall('GET', key)
    if type(raw) == 'table' and raw.err then
      t, found = from_hash(key)
    else
      found = raw ~= false
      if found then t = cmsgpack.unpack(raw) else t = {} end
    end
    t._key, t._new = key, not found
    cache[key] = t
  end
  return t
end

local function touch(t)
  if not dirty[t._key] then
    dirty[t._key] = true
    table.insert(order, t._key)
  end
end

local function drop(t)
  dirty[t._key] = nil
  cache[t._key] = {_key = t._key, _new = true}
  redis.call('DEL', t._key)
end

local function stored(t)
  local clean = {}
  for field, value in pairs(t) do
    if not PRIVATE[field] then clean[field] = value end
  end
  return cmsgpack.pack(clean)
end

-- An entitlement at rest: nothing in flight, nothing in its window, no debt or burst (AdmissionLedger's
-- `_unsettled` holds the others): a tick gives it the reading it had, without reading it.
local REST_FIELDS = {'slot_s', 'kv_s', 'wait_s', 'tok', 'done', 'rej_n', 'rej_tok', 'rej_kv', 'debt', 'burst', 'in_flight'}
local function at_rest(e)
  for _, name in ipairs(REST_FIELDS) do
    if (e[name] or 0) ~= 0 then return false end
  end
  return true
end

-- Every write of an entitlement record keeps the pool's `busy` set (entitlements with requests in flight) and
-- its `unsettled` set (those not at rest): what is in flight (IN_FLIGHT) and a tick (TICK) read those, not
-- every entitlement of the pool.
-- The pool's change mark: a new one with every save that writes (Redis's time, then a counter), a token no
-- earlier state of the pool had, even after a restart or a failover lost writes. While it stands, a snapshot
-- taken at it is still what READ would give (but for the bucket's level and the duplicate flag): COMMIT's
-- shortcut for a kept snapshot.
local function new_mark()
  local t = redis.call('TIME')
  redis.call('SET', MARK, t[1] .. '.' .. t[2] .. '.' .. redis.call('INCR', MARKS))
end

local function save()
  local ents = BASE .. 'ent:'
  local marked = false
  for _, key in ipairs(order) do
    if dirty[key] then
      if not marked then
        new_mark()
        marked = true
      end
      local t = cache[key]
      redis.call('SET', key, stored(t))
      if string.sub(key, 1, #ents) == ents then
        local id = string.sub(key, #ents + 1)
        redis.call((t.in_flight or 0) > 0 and 'SADD' or 'SREM', BUSY, id)
        redis.call(at_rest(t) and 'SREM' or 'SADD', UNSETTLED, id)
      end
    end
  end
end

local function ent_key(id) return BASE .. 'ent:' .. id end
local function queue_key(id) return BASE .. 'q:' .. id end
local function run_key(id) return BASE .. 'run:' .. id end
local function req_key(id) return BASE .. 'req:' .. id end

local function field(t, name) return t[name] or 0 end

-- A new entitlement: empty levels, a full bucket, a window opened now (EntitlementRecord.__init__).
local function entitlement(id, now)
  local e = load(ent_key(id))
  if e._new then
    e._new = false
    e.in_flight, e.kv_in_flight, e.running, e.kv_running = 0, 0, 0, 0
    e.debt, e.burst, e.bcap, e.brate = 0, 0, -1, 0
    e.last_change, e.slot_s, e.kv_s, e.wait_s, e.tok, e.done, e.rej_n, e.rej_tok, e.rej_kv = now, 0, 0, 0, 0, 0, 0, 0, 0
    touch(e)
  end
  return e
end

-- The token bucket (apps/policy/bucket.py): refilled in proportion to time, never above its capacity.
local function bucket_level(e, now)
  if field(e, 'bcap') < 0 then return math.huge end
  if e.ts == nil then
    e.level, e.ts = e.bcap, now
    touch(e)
  elseif now > e.ts then
    local level = e.level + (now - e.ts) * e.brate
    if level < e.bcap then e.level = level else e.level = e.bcap end
    e.ts = now
    touch(e)
  end
  return e.level
end

local function bucket_refund(e, amount, now)
  if field(e, 'bcap') < 0 then return end
  local level = bucket_level(e, now) + amount
  if level < e.bcap then e.level = level else e.level = e.bcap end
  touch(e)
end

-- The caller's limits of the entitlement's bucket (AdmissionLedger.upsert_entitlement): a new rate keeps the
-- level refilled at the old one, clipped to the new capacity; a bucket that appears starts full.
local function bucket_limits(e, capacity, rate, now)
  if capacity < 0 then
    if e.bcap ~= -1 then e.bcap, e.brate, e.level, e.ts = -1, 0, nil, nil; touch(e) end
    return
  end
  if field(e, 'bcap') < 0 then
    e.bcap, e.brate, e.level, e.ts = capacity, rate, capacity, now
    touch(e)
  elseif e.bcap ~= capacity or e.brate ~= rate then
    bucket_level(e, now)
    e.bcap, e.brate = capacity, rate
    if e.level > capacity then e.level = capacity end
    touch(e)
  end
end

-- The served/demand window (apps/policy/window.py ServiceWindow.accumulate): integrate the levels up to now.
local function accumulate(e, now)
  local elapsed = now - e.last_change
  if elapsed > 0 then
    e.slot_s = e.slot_s + e.running * elapsed
    e.kv_s = e.kv_s + e.kv_running * elapsed
    e.wait_s = e.wait_s + (e.in_flight - e.running) * elapsed
    e.last_change = now
    touch(e)
  end
end

local function count_refusal(e, tokens, kv)
  e.rej_n = e.rej_n + 1
  e.rej_tok = e.rej_tok + tokens
  e.rej_kv = e.rej_kv + kv
  touch(e)
end

-- Idle reservations of Bound dedicated/guaranteed entitlements: the pool's total and `id`'s own share.
-- `reserved` is a flat list of pairs: entitlement id, "concurrency kv_bytes" (the RES hash, or a caller's).
local function idle_reservations(reserved, id)
  local slots, kv, own_slots, own_kv = 0, 0, 0, 0
  for i = 1, #reserved, 2 do
    local concurrency, kv_bytes = string.match(reserved[i + 1], '^(%S+) (%S+)$')
    local e = load(ent_key(reserved[i]))
    local s = tonumber(concurrency) - field(e, 'running')
    if s < 0 then s = 0 end
    local k = num(kv_bytes) - field(e, 'kv_running')
    if k < 0 then k = 0 end
    slots, kv = slots + s, kv + k
    if reserved[i] == id then own_slots, own_kv = s, k end
  end
  return slots, kv, own_slots, own_kv
end

local function reserved_idle(id)
  return idle_reservations(redis.call('HGETALL', RES), id)
end

local function publish(kind, ids)
  for _, id in ipairs(ids) do redis.call('PUBLISH', EVENTS, kind .. ':' .. id) end
end

local function wait_member(seq, id) return string.format('%016d', seq) .. id end
local function evict_member(seq, id) return string.format('%015d', 999999999999999 - seq) .. id end

-- running <- (offered | waiting): AdmissionLedger._start
local function start(pool, r, now)
  local e = load(ent_key(r.ent))
  accumulate(e, now)
  if r.state == 'waiting' then
    pool.waiting = pool.waiting - 1
    redis.call('ZREM', WAIT, r.wm)
    redis.call('ZREM', WAIT_T, r.wm)
  end
  r.state = 'running'
  pool.seq = pool.seq + 1
  r.seq = pool.seq
  redis.call('ZADD', run_key(r.ent), fmt(now), r._id)
  e.running = e.running + 1
  e.kv_running = e.kv_running + r.kv
  pool.running = pool.running + 1
  pool.kv = pool.kv + r.kv
  redis.call('ZADD', PRIO, fmt(r.prio), r._id)
  if r.ev == 1 then
    pool.ev_n = pool.ev_n + 1
    pool.ev_kv = pool.ev_kv + r.kv
    r.em = evict_member(r.seq, r._id)
    redis.call('ZADD', EVICT, fmt(r.prio), r.em)
  end
  touch(e); touch(r); touch(pool)
end

-- running -> gone: AdmissionLedger._stop
local function stop(pool, r, now)
  local e = load(ent_key(r.ent))
  accumulate(e, now)
  e.running = e.running - 1
  e.kv_running = e.kv_running - r.kv
  e.in_flight = e.in_flight - 1
  e.kv_in_flight = e.kv_in_flight - r.kv
  pool.running = pool.running - 1
  pool.kv = pool.kv - r.kv
  if r.ev == 1 then
    pool.ev_n = pool.ev_n - 1
    pool.ev_kv = pool.ev_kv - r.kv
    redis.call('ZREM', EVICT, r.em)
  end
  redis.call('ZREM', PRIO, r._id)
  redis.call('ZREM', LEASES, r._id)
  redis.call('ZREM', run_key(r.ent), r._id)
  touch(e); touch(pool)
  drop(r)
end

-- The queue's head again in qents (or the entitlement out of it once its queue is empty).
local function queue_head(ent)
  local head = redis.call('ZRANGE', queue_key(ent), 0, 0, 'WITHSCORES')
  if #head == 0 then redis.call('ZREM', QENTS, ent) else redis.call('ZADD', QENTS, head[2], ent) end
end

-- queued -> gone (cancelled or expired); it held nothing: AdmissionLedger._leave_queue
local function leave_queue(pool, r)
  local e = load(ent_key(r.ent))
  e.qlen = field(e, 'qlen') - 1
  touch(e)
  redis.call('ZREM', queue_key(r.ent), r._id)
  queue_head(r.ent)
  pool.queued = field(pool, 'queued') - 1
  redis.call('ZREM', WAIT_T, r.wm)
  redis.call('ZREM', LEASES, r._id)
  touch(pool)
  drop(r)
end

-- waiting -> gone (cancelled or expired), the whole charge refunded: AdmissionLedger._finish_waiting
local function finish_waiting(pool, r, now)
  local e = load(ent_key(r.ent))
  pool.waiting = pool.waiting - 1
  accumulate(e, now)
  e.in_flight = e.in_flight - 1
  e.kv_in_flight = e.kv_in_flight - r.kv
  bucket_refund(e, r.cost, now)
  redis.call('ZREM', WAIT, r.wm)
  redis.call('ZREM', WAIT_T, r.wm)
  redis.call('ZREM', LEASES, r._id)
  touch(e); touch(pool)
  drop(r)
  return r.cost
end

-- running -> evicted, the unproduced output refunded: AdmissionLedger._evict. A marker stays behind for the
-- victim's process, whose release of it (once it has stopped the stream) only records what was served.
local function evict_one(pool, r, now)
  local refund = r.max
  bucket_refund(load(ent_key(r.ent)), refund, now)
  stop(pool, r, now)
  redis.call('SET', req_key(r._id), stored({state = 'evicted', ent = r.ent}), 'EX', 3600)
  return refund
end

-- What a request used, for the usage records: counted here, atomically with its release, and rolled into the
-- database by the gateways' flush (USAGE), so a gateway process that dies loses none of it.
local function record_usage(tenant, ent, minute, prompt, completion)
  if tenant == nil or tenant == '' then return 0 end
  local field = tenant .. '|' .. ent .. '|' .. minute .. '|'
  local usage = BASE .. 'usage'
  redis.call('HINCRBY', usage, field .. 'r', 1)
  redis.call('HINCRBY', usage, field .. 'p', prompt)
  redis.call('HINCRBY', usage, field .. 'c', completion)
  return 1
end

local function request(id)
  local r = load(req_key(id))
  if r._new then return nil end
  r._id = id
  return r
end

-- Whether request `id` is in flight already (an evicted one's record only waits for its late release): an offer
-- of that id is a duplicate.
local function in_flight_already(id)
  local held = id ~= '' and request(id) or nil
  return held ~= nil and held.state ~= 'evicted'
end

-- The slots requests may run in: the capacity, or the dispatch budget when it is lower (AdmissionLedger.dispatch_capacity).
local function dispatch_cap(pool)
  local budget = pool.budget
  if budget ~= nil and budget >= 0 and budget < pool.cap then return budget end
  return pool.cap
end

-- An offer's charge on its entitlement: its tokens from the bucket, one more in flight, its KV bytes (COMMIT,
-- and a queue's head leaving the queue: AdmissionLedger.request and _drain_queues)
local function charge(e, r, now)
  if field(e, 'bcap') >= 0 then
    local level = bucket_level(e, now)
    if level >= r.cost then e.level = level - r.cost end
  end
  accumulate(e, now)
  e.in_flight = e.in_flight + 1
  e.kv_in_flight = e.kv_in_flight + r.kv
  touch(e)
end

-- The budget is what is full, not the capacity: AdmissionLedger._budget_bound
local function budget_bound(pool)
  local budget = pool.budget
  return budget ~= nil and budget >= 0 and budget <= pool.running and pool.running < pool.cap
end

-- (slots lacking, KV bytes lacking, entitled): AdmissionLedger._room_for
local function room_for(pool, r)
  local missing_slots = 1 - (dispatch_cap(pool) - pool.running)
  local missing_kv = r.kv - (pool.kv_cap - pool.kv)
  if r.ev == 1 then return missing_slots, missing_kv, true end
  local slots, kv, own_slots, own_kv = reserved_idle(r.ent)
  -- other reservations' idle room is off limits, except that a request within its own may claim that much
  local unreachable_slots = missing_slots - pool.ev_n
  local unreachable_kv = missing_kv - pool.ev_kv
  local entitled = (unreachable_slots + (slots - own_slots) <= 0 or (own_slots > 0 and unreachable_slots <= 0))
    and (unreachable_kv + (kv - own_kv) <= 1e-9
      or (own_kv > 0 and r.kv - own_kv <= 1e-9 and unreachable_kv <= 1e-9))
  return missing_slots, missing_kv, entitled
end

local function fits(pool, r)
  local missing_slots, missing_kv, entitled = room_for(pool, r)
  return entitled and missing_slots <= 0 and missing_kv <= 1e-9 and pool.sat < 1.0
end

local function limit(e, name)
  local v = e[name]
  if v == nil then return -1 end
  return v
end

-- Whether a queue's head may leave it: apps.policy.queues.within_own_limits
local function own_fits(e, r, room, now)
  local borrow = false
  local conc = limit(e, 'conc')
  if conc >= 0 and e.in_flight >= conc then
    local ceiling = limit(e, 'bconc')
    if e.mb ~= 1 or (ceiling >= 0 and e.in_flight >= ceiling) then return false end
    borrow = true
  end
  if field(e, 'bcap') >= 0 and bucket_level(e, now) < r.cost then return false end
  local chi = limit(e, 'kvl')
  if chi >= 0 and r.kv > 0 and e.kv_in_flight + r.kv > chi then
    local ceiling = limit(e, 'bkvl')
    if e.mb ~= 1 or (ceiling >= 0 and e.kv_in_flight + r.kv > ceiling) then return false end
    borrow = true
  end
  return room or not borrow
end

local function threshold()
  local low = redis.call('ZRANGE', PRIO, 0, 0, 'WITHSCORES')
  if #low == 0 then return -math.huge end
  return tonumber(low[2])
end

-- Let the entitlements' queues go, oldest head first: AdmissionLedger._drain_queues
local function drain_queues(pool, now)
  local started = {}
  for _, ent in ipairs(redis.call('ZRANGE', QENTS, 0, -1)) do
    local e = load(ent_key(ent))
    while true do
      local head = redis.call('ZRANGE', queue_key(ent), 0, 0)
      if #head == 0 then break end
      local r = request(head[1])
      if r == nil then
        redis.call('ZREM', queue_key(ent), head[1])
      else
        if field(e, 'bound') ~= 1 then break end
        local room = fits(pool, r)
        if not own_fits(e, r, room, now) then break end
        if not room and r.prio <= threshold() and not budget_bound(pool) then break end
        -- queued -> charged like an offer (bucket, in flight, KV bytes), then started or waiting
        redis.call('ZREM', queue_key(ent), r._id)
        pool.queued = pool.queued - 1
        e.qlen = field(e, 'qlen') - 1
        r.own = 0
        charge(e, r, now)
        touch(r); touch(pool)
        if room then
          r.state = ''
          redis.call('ZREM', WAIT_T, r.wm)
          start(pool, r, now)
          table.insert(started, r._id)
        else
          r.state = 'waiting'
          pool.waiting = pool.waiting + 1
          redis.call('ZADD', WAIT, fmt(-r.prio), r.wm)
        end
      end
    end
    queue_head(ent)
  end
  return started
end

-- Start waiting requests, highest priority first, while the pool has room, then let the queues go:
-- AdmissionLedger._drain
local function drain(pool, now)
  local started = {}
  while true do
    local head = redis.call('ZRANGE', WAIT, 0, 0)
    if #head == 0 then break end
    local r = request(string.sub(head[1], 17))
    if r == nil then
      redis.call('ZREM', WAIT, head[1])
    else
      if not fits(pool, r) then break end
      start(pool, r, now)
      table.insert(started, r._id)
    end
  end
  if field(pool, 'queued') > 0 then
    for _, id in ipairs(drain_queues(pool, now)) do table.insert(started, id) end
  end
  return started
end

-- Evict lower-priority preemptible work, all or nothing: AdmissionLedger._evict_for
local function evict_for(pool, r, now)
  if pool.sat >= 1.0 then return {}, {} end
  local missing_slots, missing_kv, entitled = room_for(pool, r)
  local limit = pool.max_ev
  if not entitled or missing_slots > limit then return {}, {} end
  local chosen = {}
  while missing_slots > 0 or missing_kv > 0 do
    local victim = nil
    if #chosen < limit then
      local found = redis.call('ZRANGE', EVICT, #chosen, #chosen, 'WITHSCORES')
      if #found > 0 and tonumber(found[2]) < r.prio then victim = request(string.sub(found[1], 16)) end
    end
    if victim == nil then return {}, {} end
    table.insert(chosen, victim)
    missing_slots = missing_slots - 1
    missing_kv = missing_kv - victim.kv
  end
  local evicted = {}
  for _, victim in ipairs(chosen) do
    evict_one(pool, victim, now)
    table.insert(evicted, victim._id)
  end
  return evicted, drain(pool, now)
end

-- The pool as the caller's snapshot describes it (capacity, saturation, reservations, timeouts); a pool seen
-- for the first time opens its tick window now (AdmissionLedger.__init__).
local function pool_record(now)
  local pool = load(POOL)
  if pool._new then
    pool._new = false
    pool.running, pool.kv, pool.ev_n, pool.ev_kv, pool.waiting, pool.seq, pool.ver = 0, 0, 0, 0, 0, 0, 0
    pool.queued, pool.budget, pool.cap, pool.kv_cap, pool.sat, pool.timeout, pool.max_ev = 0, -1, 0, 0, 0, 0, 0
    pool.last_tick = now
    touch(pool)
  end
  return pool
end

local function pool_config(now, cap, kv_cap, sat, timeout, max_ev, reserved)
  local pool = pool_record(now)
  pool.cap, pool.kv_cap, pool.sat, pool.timeout, pool.max_ev = tonumber(cap), num(kv_cap), num(sat), num(timeout), tonumber(max_ev)
  touch(pool)
  if reserved ~= nil then
    redis.call('DEL', RES)
    for i = 1, #reserved, 2 do redis.call('HSET', RES, reserved[i], reserved[i + 1]) end
  end
  return pool
end

-- The pool's version, which COMMIT compares with the one its decision was read at, moves only when a
-- transition takes room (a start, a wait, less capacity): a decision to admit or to wait stays right when room
-- was only freed meanwhile (and a wait then starts at once), so concurrent releases cause no retries.
local function took_room(pool)
  pool.ver = pool.ver + 1
  touch(pool)
end

-- READ's snapshot of entitlement `id` as a list of fields (read.lua lists them), and its bucket level. With
-- `capacity` nil the bucket keeps the limits it was last given (a snapshot taken after RELEASE). `reserved` is
-- a flat list of pairs as in `idle_reservations`. Nothing is written, whatever it loads.
local function snapshot(id, capacity, rate, request_id, reserved, now)
  local e = entitlement(id, now)
  if capacity ~= nil then bucket_limits(e, capacity, rate, now) end
  local level = bucket_level(e, now)
  local pool = load(POOL)
  local idle_slots, idle_kv = idle_reservations(reserved, '')
  local low = redis.call('ZRANGE', PRIO, 0, 0, 'WITHSCORES')
  local low_evict = redis.call('ZRANGE', EVICT, 0, 0, 'WITHSCORES')
  -- The oldest start only matters to a refusal by its own limits (Retry-After): read when they are reached.
  local oldest = {}
  if (limit(e, 'conc') >= 0 and e.in_flight >= e.conc) or (limit(e, 'kvl') >= 0 and e.kv_in_flight > 0) then
    oldest = redis.call('ZRANGE', run_key(id), 0, 0, 'WITHSCORES')
  end
  local duplicate = in_flight_already(request_id) and '1' or '0'
  return {fmt(e.in_flight), fmt(e.kv_in_flight), fmt(e.running), fmt(e.kv_running), fmt(level),
          fmt(e.debt), fmt(e.burst), fmt(field(pool, 'running')), fmt(field(pool, 'kv')),
          fmt(idle_slots), fmt(idle_kv), low[2] or '', low_evict[2] or '', fmt(field(pool, 'ev_n')),
          fmt(field(pool, 'ev_kv')), fmt(field(pool, 'ver')),
          fmt(field(e, 'qlen')), oldest[2] or '', fmt(pool.budget or -1), duplicate,
          redis.call('GET', MARK) or ''}, level
end

-- The entitlement's snapshot after a transition, as one string (RELEASE's reply, and COMMIT's when asked): the
-- bucket keeps the limits it was last given, the reservations are the pool's stored ones.
local function snapshot_after(id, now)
  return table.concat((snapshot(id, nil, nil, '', redis.call('HGETALL', RES), now)), ' ')
end

-- What a decision taken on a snapshot depends on, but for the bucket's level, which only rises with time (a
-- charge moves the levels beside it), the oldest start (read for refusals only), the duplicate flag and the
-- change mark: apps.gateway.redis_snapshot.fingerprint writes the same from READ's reply.
local function fingerprint(fields)
  local kept = {}
  for i, value in ipairs(fields) do
    if i ~= 5 and i ~= 18 and i ~= 20 and i ~= 21 then table.insert(kept, value) end
  end
  return table.concat(kept, ' ')
end
