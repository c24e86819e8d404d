-- RELEASE: a running request completed (its unused charge refunded, what it used counted as served), or a
-- waiting one was cancelled (its whole charge refunded); waiters then start (AdmissionLedger.release).
-- Unknown ids change nothing (a second release of the same request is harmless). With a tenant and a minute,
-- what the backend served goes to the usage counts in the same step; an evicted request's release records
-- only that (the eviction already released it).
-- KEYS: pool prefix.  ARGV: now, request id, output tokens ('' = unknown), prompt tokens (''),
-- tenant id ('' = record no usage), minute.
-- Reply: {outcome, started, refund, usage recorded (1/0), the entitlement's snapshot after it (as READ gives
-- it, for the caller's next decision; '' when nothing was released)}.
local now = clock(ARGV[1])
local id = ARGV[2]
local r = request(id)
if r == nil then return {'unknown', {}, '0', 0, ''} end
local served_prompt, served_completion = math.max(0, tonumber(ARGV[4]) or 0), math.max(0, tonumber(ARGV[3]) or 0)
if r.state == 'evicted' then
  local recorded = record_usage(ARGV[5], r.ent, ARGV[6], served_prompt, served_completion)
  redis.call('DEL', req_key(id))
  return {'unknown', {}, '0', recorded, ''}
end
local pool = load(POOL)
local recorded = 0
local outcome, refund, started
if r.own == 1 then
  leave_queue(pool, r)
  refund, outcome = 0, 'cancelled'
elseif r.state == 'waiting' then
  refund = finish_waiting(pool, r, now)
  outcome = 'cancelled'
else
  local produced, prompt = r.max, r.input
  local output = tonumber(ARGV[3])
  if output ~= nil and output == output then
    if output < 0 then output = 0 end
    if output > r.max then output = r.max end
    produced = math.floor(output)
  end
  local reported = tonumber(ARGV[4])
  if reported ~= nil and reported == reported then
    if reported < 0 then reported = 0 end
    prompt = math.floor(reported)
  end
  local used = prompt + produced
  refund = r.cost - used
  if refund < 0 then refund = 0 end
  local e = load(ent_key(r.ent))
  if refund > 0 then bucket_refund(e, refund, now) end
  stop(pool, r, now)
  e.tok = e.tok + used
  e.done = e.done + 1
  touch(e)
  outcome = 'completed'
  recorded = record_usage(ARGV[5], r.ent, ARGV[6], served_prompt, served_completion)
end
started = drain(pool, now)
if #started > 0 then took_room(pool) end
save()
publish('s', started)
return {outcome, started, fmt(refund), recorded, snapshot_after(r.ent, now)}
