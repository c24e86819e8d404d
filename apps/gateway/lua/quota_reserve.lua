-- QUOTA RESERVE: the request's prompt plus max_tokens, priced, against every quota it is under, all or
-- nothing (apps.policy.quota.QuotaBook.reserve). One hash per tenant holds its quotas and its entitlements'
-- (`tp:gw:{q:<tenant>}:quota`, one cluster slot), so a tenant-wide quota is exact across pools.
--   w:<key> window id, u:<key> used, r:<key> reserved; h:<request id> the request's holds (JSON)
-- A hold may carry a lease (QuotaBook.reserve with a claim's lease_s): its deadline in the scope's lease zset,
-- renewed by its holder while the request lives; QUOTA LEASES settles the lapsed ones.
-- KEYS: the quota hash, the lease zset.  ARGV: request id, input tokens, max tokens, expiry seconds, now
-- ('' = Redis time), lease seconds ('' = no lease), then per quota: key, limit, window id, seed used, input
-- weight, output weight.
-- Returns {1, used, reserved, ...} (each quota after the reservation), {0, index, used, reserved} for the
-- first quota that cannot fit, or {-1} for a request id that already holds a reservation.
local q = KEYS[1]
local id = ARGV[1]
if redis.call('HEXISTS', q, 'h:' .. id) == 1 then return {-1} end
local input, max_tokens = tonumber(ARGV[2]), tonumber(ARGV[3])
local quotas = {}
for i = 7, #ARGV, 6 do
  local key, limit, window = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2]
  local stored = redis.call('HMGET', q, 'w:' .. key, 'u:' .. key, 'r:' .. key)
  local used, reserved = tonumber(ARGV[i + 3]), 0
  if stored[1] == window then used, reserved = num(stored[2]), num(stored[3]) end
  local cost = input * tonumber(ARGV[i + 4]) + max_tokens * tonumber(ARGV[i + 5])
  if used + reserved + cost > limit + 1e-9 then
    return {0, #quotas + 1, fmt(used), fmt(reserved)}
  end
  quotas[#quotas + 1] = {key = key, window = window, used = used, reserved = reserved + cost, cost = cost,
                         wi = tonumber(ARGV[i + 4]), wo = tonumber(ARGV[i + 5])}
end
local out, holds = {1}, {}
for _, quota in ipairs(quotas) do
  redis.call('HSET', q, 'w:' .. quota.key, quota.window, 'u:' .. quota.key, fmt(quota.used),
             'r:' .. quota.key, fmt(quota.reserved))
  holds[#holds + 1] = {quota.key, quota.window, fmt(quota.cost), fmt(quota.wi), fmt(quota.wo)}
  out[#out + 1] = fmt(quota.used)
  out[#out + 1] = fmt(quota.reserved)
end
redis.call('HSET', q, 'h:' .. id, cjson.encode(holds))
if ARGV[6] ~= '' then
  redis.call('ZADD', KEYS[2], fmt(clock(ARGV[5]) + tonumber(ARGV[6])), id)
  redis.call('EXPIRE', KEYS[2], tonumber(ARGV[4]))
end
-- Kept a while past the longest window (a hold without a lease stays until then).
redis.call('EXPIRE', q, tonumber(ARGV[4]))
return out
