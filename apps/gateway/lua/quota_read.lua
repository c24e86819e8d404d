-- QUOTA READ: where quotas stand (apps.policy.quota.QuotaBook.standing). KEYS: the quota hash.
-- ARGV: per quota: key, window id, seed used.  Returns used, reserved per quota.
local q = KEYS[1]
local out = {}
for i = 1, #ARGV, 3 do
  local stored = redis.call('HMGET', q, 'w:' .. ARGV[i], 'u:' .. ARGV[i], 'r:' .. ARGV[i])
  if stored[1] == ARGV[i + 1] then
    out[#out + 1] = fmt(num(stored[2]))
    out[#out + 1] = fmt(num(stored[3]))
  else
    out[#out + 1] = fmt(tonumber(ARGV[i + 2]))
    out[#out + 1] = '0'
  end
end
return out
