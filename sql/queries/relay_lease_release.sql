-- Give back the slots $2 that relay $1 holds (more than its share, or all of
-- them when it stops): free at once for the other relays.
UPDATE outbox_relay_partitions
   SET owner = NULL,
       token = NULL,
       lease_until = '-infinity'
 WHERE owner = $1
   AND slot = ANY($2::int[])
