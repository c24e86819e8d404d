-- QUOTA SETTLE: drop the request's reservations and count what it used, never more than it reserved
-- (apps.policy.quota.QuotaBook.settle); a reservation from a window that has ended counts in neither.
-- Settling twice changes nothing. KEYS: the quota hash, the lease zset.  ARGV: request id, input tokens, output tokens.
local q = KEYS[1]
local field = 'h:' .. ARGV[1]
redis.call('ZREM', KEYS[2], ARGV[1])
local raw = redis.call('HGET', q, field)
if not raw then return 0 end
redis.call('HDEL', q, field)
local input, output = math.max(0, tonumber(ARGV[2]) or 0), math.max(0, tonumber(ARGV[3]) or 0)
for _, hold in ipairs(cjson.decode(raw)) do
  local key, window, amount = hold[1], hold[2], tonumber(hold[3])
  local stored = redis.call('HMGET', q, 'w:' .. key, 'u:' .. key, 'r:' .. key)
  if stored[1] == window then
    local used = input * tonumber(hold[4]) + output * tonumber(hold[5])
    if used > amount then used = amount end
    local reserved = num(stored[3]) - amount
    if reserved < 0 then reserved = 0 end
    redis.call('HSET', q, 'u:' .. key, fmt(num(stored[2]) + used), 'r:' .. key, fmt(reserved))
  end
end
return 1
