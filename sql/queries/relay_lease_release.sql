-- Give back the slots @slots that relay @relay holds (more than its share, or all of
-- them when it stops): free at once for the other relays.
UPDATE outbox_relay_partitions
   SET owner = NULL,
       token = NULL,
       owner_pid = NULL,
       lease_until = '-infinity'
 WHERE owner = @relay
   AND slot = ANY(@slots::int[])
