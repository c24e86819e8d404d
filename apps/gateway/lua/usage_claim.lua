-- USAGE CLAIM: the pool's usage counts, taken for writing to the database. What was counted since the last
-- claim moves to a claim of its own (`token`); claims whose lease ran out (a gateway that died between taking
-- and writing them, or whose write failed) are taken over as they are. Every claim keeps its token, and the
-- database applies a token once (apps.gateway.usage), so nothing is lost and nothing counted twice.
-- ARGV: now, new token, lease seconds.  Returns {token, field, value, ..., '', token, ...}.
local now = clock(ARGV[1])
local claims = BASE .. 'usage:claims'
if redis.call('EXISTS', BASE .. 'usage') == 1 then
  redis.call('RENAME', BASE .. 'usage', BASE .. 'usage:claim:' .. ARGV[2])
  redis.call('ZADD', claims, fmt(now - 1), ARGV[2])
end
local out = {}
for _, token in ipairs(redis.call('ZRANGEBYSCORE', claims, '-inf', fmt(now))) do
  local flat = redis.call('HGETALL', BASE .. 'usage:claim:' .. token)
  if #flat == 0 then
    redis.call('ZREM', claims, token)
  else
    redis.call('ZADD', claims, fmt(now + tonumber(ARGV[3])), token)
    table.insert(out, token)
    for _, item in ipairs(flat) do table.insert(out, item) end
    table.insert(out, '')
  end
end
return out
