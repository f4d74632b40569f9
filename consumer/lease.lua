-- Take or renew a consumer's lease on one partition of a group.
--
-- The lease value is "<epoch>|<holder>": holder is the consumer's name and
-- process token; epoch comes from a counter that only grows, so every
-- acquisition has a value no earlier holder ever had. The effect script
-- compares the lease value with the one its consumer holds (the fencing
-- token): a consumer that lost its lease, however late its writes arrive,
-- can never apply an effect over the new owner.
--
-- A lease held under this consumer's own name by another process is taken
-- over at once: that process is dead or stalled, since a consumer runs only
-- once it holds its name (Keys.Consumer), and the new epoch fences it. So a
-- consumer restarted under its name resumes its partitions without waiting
-- for their leases to expire.
--
-- KEYS[1] lease (string)   KEYS[2] epoch counter
-- ARGV[1] holder: "<consumer name>|<process token>"   ARGV[2] TTL (ms)
-- Returns the lease value when this holder has the lease (taken now or
-- renewed), false when another holder has it.
local cur = redis.call('GET', KEYS[1])
if cur then
  local sep = string.find(cur, '|', 1, true)
  local held = sep and string.sub(cur, sep + 1) or ''
  if held == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return cur
  end
  local name = string.match(ARGV[1], '^[^|]*')
  if string.match(held, '^[^|]*') ~= name then
    return false
  end
end
local value = redis.call('INCR', KEYS[2]) .. '|' .. ARGV[1]
-- The counter is bounded like every other key: it lives a week past the
-- last acquisition. Were it to expire and restart, values would still
-- differ by the holder's process token.
redis.call('PEXPIRE', KEYS[2], 604800000)
redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
return value
