-- Lease up to @count slots that nobody holds, or whose lease ran out, to relay
-- @relay for @lease_ms milliseconds, each with a new fencing token and the
-- relay's LISTEN backend @pid (0: none; migration 0012). SKIP LOCKED: relays
-- acquiring at the same moment take different slots.
WITH free AS (
    SELECT slot
      FROM outbox_relay_partitions
     WHERE lease_until < now()
     ORDER BY slot
     LIMIT @count
       FOR UPDATE SKIP LOCKED
)
UPDATE outbox_relay_partitions p
   SET owner = @relay,
       token = gen_random_uuid(),
       lease_until = now() + @lease_ms * interval '1 millisecond',
       owner_pid = nullif(@pid::int, 0)
  FROM free
 WHERE p.slot = free.slot
RETURNING p.slot, p.token
