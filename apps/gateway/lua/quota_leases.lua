-- QUOTA LEASES: renew the leases of the holder's holds, then settle every hold whose lease lapsed at its whole
-- amount, as a release with its usage unknown (QuotaBook.renew, QuotaBook.reap).
-- KEYS: the quota hash, the lease zset.  ARGV: now ('' = Redis time), lease seconds, request ids to renew.
-- Returns the ids of the holds settled, by deadline.
local q = KEYS[1]
local now = clock(ARGV[1])
local deadline = fmt(now + tonumber(ARGV[2]))
for i = 3, #ARGV do redis.call('ZADD', KEYS[2], 'XX', deadline, ARGV[i]) end
local reaped = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', fmt(now))
for _, id in ipairs(reaped) do
  redis.call('ZREM', KEYS[2], id)
  local raw = redis.call('HGET', q, 'h:' .. id)
  if raw then
    redis.call('HDEL', q, 'h:' .. id)
    for _, hold in ipairs(cjson.decode(raw)) do
      local key, window, amount = hold[1], hold[2], tonumber(hold[3])
      local stored = redis.call('HMGET', q, 'w:' .. key, 'u:' .. key, 'r:' .. key)
      if stored[1] == window then
        local reserved = num(stored[3]) - amount
        if reserved < 0 then reserved = 0 end
        redis.call('HSET', q, 'u:' .. key, fmt(num(stored[2]) + amount), 'r:' .. key, fmt(reserved))
      end
    end
  end
end
return reaped
