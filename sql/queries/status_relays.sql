-- Every relay the database knows of, for 'outbox status': the members
-- (migrations 0010 and 0012), the owners of live partition leases and the
-- relays with claimed rows, each with the backend pid that names it, whether
-- that backend still holds its ownership lock (alive: outbox_live_relays;
-- a relay killed, or whose LISTEN connection died, is not; one that renewed
-- its membership while its LISTEN connection was down has no pid, and is
-- alive while that membership runs, as the relays count each other in
-- relay_lease_share.sql), its ownership
-- ('rows', 'partitions', '' when dead), the slots it leases with the time
-- left on the longest lease, and the rows it has claimed. A dead relay is
-- buried by the live ones within a fraction of a second (relay_bury.sql,
-- relay_reap.sql): one that stays here dead has no live relay to bury it.
WITH live AS (
    SELECT pid, min(ownership) AS ownership FROM outbox_live_relays GROUP BY pid
), slots AS (
    SELECT owner, max(owner_pid) AS pid, count(*)::int AS slots,
           extract(epoch FROM max(lease_until) - now())::float8 AS lease_left
      FROM outbox_relay_partitions
     WHERE owner IS NOT NULL AND lease_until > now()
     GROUP BY owner
), claims AS (
    SELECT claimed_by AS owner, max(claimed_pid) AS pid, count(*)::int AS claimed
      FROM outbox_messages
     WHERE unpublished AND status = 'publishing' AND claimed_by IS NOT NULL
     GROUP BY claimed_by
), relays AS (
    SELECT coalesce(m.owner, s.owner, c.owner) AS name,
           coalesce(m.pid, s.pid, c.pid) AS pid,
           m.seen_until,
           coalesce(s.slots, 0) AS slots,
           coalesce(s.lease_left, 0) AS lease_left,
           coalesce(c.claimed, 0) AS claimed
      FROM outbox_relay_members m
      FULL JOIN slots s ON s.owner = m.owner
      FULL JOIN claims c ON c.owner = coalesce(m.owner, s.owner)
)
SELECT r.name, coalesce(r.pid, 0) AS pid,
       l.pid IS NOT NULL OR (r.pid IS NULL AND r.seen_until > now()) AS alive,
       CASE l.ownership WHEN 1 THEN 'rows' WHEN 2 THEN 'partitions' ELSE '' END AS ownership,
       r.slots, r.lease_left, r.claimed
  FROM relays r
  LEFT JOIN live l ON l.pid = r.pid
 ORDER BY r.name
