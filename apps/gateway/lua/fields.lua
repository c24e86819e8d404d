-- FIELDS (no writes): one field of several of the pool's records, for readers outside the transitions
-- (gauges, a waiter polling its request's state).  ARGV: field, then records ('pool', 'ent:<id>', 'req:<id>').
-- Returns one value per record: a number formatted exactly, a string as stored, or false when absent.
local out = {}
for i = 2, #ARGV do
  local value = load(BASE .. ARGV[i])[ARGV[1]]
  if type(value) == 'number' then value = fmt(value) elseif value == nil then value = false end
  out[#out + 1] = value
end
return out
