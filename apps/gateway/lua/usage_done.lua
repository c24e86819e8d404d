-- USAGE DONE: a claim is in the database; forget it.  ARGV: token.
redis.call('DEL', BASE .. 'usage:claim:' .. ARGV[1])
redis.call('ZREM', BASE .. 'usage:claims', ARGV[1])
return 1
