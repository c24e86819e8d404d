-- DYNAMICS_READ (no writes): the debt and burst of several of the pool's entitlements, as the last tick left
-- them (0 for one the store never saw), for the gauges and the dashboard: one call for many, not one each.
-- ARGV: entitlement ids.  Returns {debt, burst, debt, burst, ...} in ARGV's order.
local out = {}
for i = 1, #ARGV do
  local e = load(ent_key(ARGV[i]))
  out[#out + 1] = fmt(field(e, 'debt'))
  out[#out + 1] = fmt(field(e, 'burst'))
end
return out
