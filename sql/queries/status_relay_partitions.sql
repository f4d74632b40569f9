-- The relays' partition slots (migration 0010), for 'outbox status': each
-- slot's owner while its lease runs (NULL: free), whether that owner's
-- backend is alive (outbox_live_relays; a lease taken while the relay's
-- LISTEN connection was down has no pid of its own: its member row's, and
-- a member without a pid is alive while its membership runs), the seconds
-- left on the lease, and the unpublished rows of the slot among the oldest
-- @max_rows unpublished rows, with the age of its oldest one (the slot's
-- lag). It hashes those rows' partition keys (the partial index
-- outbox_messages_unpublished, in seq order): a second or so per million
-- rows of backlog, so a caller that reads often bounds @max_rows.
WITH n AS (
    SELECT count(*)::int AS slots FROM outbox_relay_partitions
), waiting AS (
    SELECT outbox_relay_slot(coalesce(partition_key, aggregate_id), (SELECT slots FROM n)) AS slot,
           count(*) AS waiting,
           extract(epoch FROM now() - min(created_at))::float8 AS oldest
      FROM (SELECT partition_key, aggregate_id, created_at
              FROM outbox_messages
             WHERE unpublished
             ORDER BY seq
             LIMIT @max_rows::bigint) u
     GROUP BY 1
)
SELECT p.slot,
       CASE WHEN p.lease_until > now() THEN p.owner END AS owner,
       coalesce(p.lease_until > now()
                AND (coalesce(p.owner_pid, (SELECT m.pid FROM outbox_relay_members m WHERE m.owner = p.owner))
                         IN (SELECT pid FROM outbox_live_relays)
                     OR EXISTS (SELECT 1 FROM outbox_relay_members m
                                 WHERE m.owner = p.owner AND m.pid IS NULL AND m.seen_until > now())), false) AS alive,
       CASE WHEN p.lease_until > now() THEN extract(epoch FROM p.lease_until - now()) ELSE 0 END::float8 AS lease_left,
       coalesce(w.waiting, 0) AS waiting,
       coalesce(w.oldest, 0) AS oldest
  FROM outbox_relay_partitions p
  LEFT JOIN waiting w ON w.slot = p.slot
 ORDER BY p.slot
