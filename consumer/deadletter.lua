-- Move one stream entry to the dead-letter stream atomically with its XACK.
-- The dead-letter entry keeps the original fields (so it can be re-added to
-- the source stream as is) plus dlq_* fields that say why.
--
-- KEYS[1] source stream  KEYS[2] dead-letter stream  KEYS[3] stats hash
-- ARGV[1] group  ARGV[2] entry id  ARGV[3] reason  ARGV[4] deliveries  ARGV[5] consumer
-- Returns 1 if moved, 0 if the entry was no longer pending (someone acked it).
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  return 0
end
local fields = {}
local entry = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])[1]
if entry then
  for _, v in ipairs(entry[2]) do
    table.insert(fields, v)
  end
end
for _, v in ipairs({'dlq_stream', KEYS[1], 'dlq_group', ARGV[1], 'dlq_entry_id', ARGV[2],
                    'dlq_reason', ARGV[3], 'dlq_deliveries', ARGV[4], 'dlq_consumer', ARGV[5]}) do
  table.insert(fields, v)
end
redis.call('XADD', KEYS[2], '*', unpack(fields))
redis.call('HINCRBY', KEYS[3], 'dead_lettered', 1)
return 1
