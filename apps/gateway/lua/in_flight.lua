-- IN_FLIGHT (no writes): the pool's entitlements with requests in flight (waiting or running), and how many:
-- the members of its `busy` set, so that the cost is that of the busy ones, not of the pool's size.
-- Returns {id, count, id, count, ...}.
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', BUSY)) do
  local count = field(load(ent_key(id)), 'in_flight')
  if count > 0 then
    out[#out + 1] = id
    out[#out + 1] = fmt(count)
  end
end
return out
