-- Partition slots (migration 0010) per relay holding a live lease on them;
-- owner NULL: free, or its lease ran out. Empty unless relays run with
-- --ownership partitions.
SELECT CASE WHEN lease_until > now() THEN owner END AS owner, count(*)::int AS slots
  FROM outbox_relay_partitions
 GROUP BY 1
