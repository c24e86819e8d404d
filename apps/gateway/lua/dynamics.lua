-- DYNAMICS: the new debt and burst of the pool's entitlements after a tick.  ARGV: id, debt, burst, ...
for i = 1, #ARGV, 3 do
  local e = load(ent_key(ARGV[i]))
  e.debt, e.burst = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  touch(e)
end
save()
return 1
