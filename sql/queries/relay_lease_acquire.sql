-- Lease up to $3 slots that nobody holds, or whose lease ran out, to relay
-- $1 for $2 milliseconds, each with a new fencing token. SKIP LOCKED: relays
-- acquiring at the same moment take different slots.
WITH free AS (
    SELECT slot
      FROM outbox_relay_partitions
     WHERE lease_until < now()
     ORDER BY slot
     LIMIT $3
       FOR UPDATE SKIP LOCKED
)
UPDATE outbox_relay_partitions p
   SET owner = $1,
       token = gen_random_uuid(),
       lease_until = now() + $2 * interval '1 millisecond'
  FROM free
 WHERE p.slot = free.slot
RETURNING p.slot, p.token
