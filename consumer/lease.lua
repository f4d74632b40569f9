-- Take or renew a consumer's lease on one partition of a group.
--
-- The lease value is "<epoch>|<holder>": holder is the consumer's name and
-- process token; epoch only grows, so every acquisition has a value no
-- earlier holder ever had, and a later acquisition a greater epoch. The effect script
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
-- The epoch only grows: the next one is the last one plus one, or the
-- server's time in milliseconds if that is greater. The counter is bounded
-- like every other key (it lives a week past the last acquisition); were it
-- to expire, the clock keeps the next epoch above every earlier one, so a
-- fence kept outside Redis (the inbox's consumer_fences, compared by
-- epoch) never sees one go back.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local epoch = math.max((tonumber(redis.call('GET', KEYS[2])) or 0) + 1, now)
local e = string.format('%d', epoch)
redis.call('SET', KEYS[2], e, 'PX', 604800000)
local value = e .. '|' .. ARGV[1]
redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
return value
