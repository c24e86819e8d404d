-- Extend the leases of slots this process holds. KEYS: slots.  ARGV: lease seconds, ids...
local deadline = clock('') + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', fmt(deadline), ARGV[i]) end
return 1
