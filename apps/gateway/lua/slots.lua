-- The pool's shared dispatch budget (seed 002's one controller per pool): slots in a zset scored by lease
-- expiry; a slot whose lease ran out (its process died) is dropped on the next take. The budget is the one
-- the shared AIMD tick published, clipped to the pool's capacity the caller knows; none published: the
-- capacity. A request already holding a slot renews it.
local function take_slot(slots, budget_key, request_id, lease_s, capacity, now)
  redis.call('ZREMRANGEBYSCORE', slots, '-inf', now)
  local budget = tonumber(redis.call('GET', budget_key) or capacity) or capacity
  if budget > capacity then budget = capacity end
  local held = redis.call('ZCARD', slots)
  local mine = redis.call('ZSCORE', slots, request_id)
  if mine or held < budget then
    redis.call('ZADD', slots, now + lease_s, request_id)
    if not mine then held = held + 1 end
    return {1, budget, held}
  end
  return {0, budget, held}
end
