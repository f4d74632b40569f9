-- A relay's LISTEN connection came back (a new backend, this session): its
-- claims and partition slots taken under its earlier LISTEN backends
-- @past_pids are stamped with this one's pid, so that the relays do not take
-- them for a dead relay's (migrations 0012, 0018: an earlier backend may
-- still be alive behind a half-open link, but only a member's pid is a live
-- relay's). Run on the LISTEN connection, in the transaction of
-- relay_register.sql.
--
-- Of the claims, only those of the batches the relay knows it holds
-- (@tokens, its latest claims that returned rows): a claim whose reply was
-- lost (the connection closed after its COMMIT) is not the relay's to
-- publish, as it does not know of it; left under the earlier pid, it is
-- returned to pending as a dead relay's at once (the relay asks its reaper,
-- relay/listen.go), not when its lease runs out.
--
-- A claim taken while the LISTEN connection was down has no pid: the
-- relay's (@relay) that it knows are stamped too; one whose reply was lost
-- is stamped with an earlier backend's pid (the last of @past_pids, gone
-- or no member's), so the reaper returns it at once as well. On a process's
-- first LISTEN connection (@past_pids empty, @tokens too) every claim of
-- @relay without a pid is a previous process's, killed while its LISTEN
-- connection was down: each gets -1, no backend's pid, and is returned so.
-- No index holds the 'publishing' rows alone (one would cost every claim its
-- HOT update): this walks the unpublished rows' index, about 0.25 s per
-- million unpublished rows on the reference machine, at each LISTEN
-- connection.
-- SKIP LOCKED: a row or slot another transaction holds is being changed
-- (by this relay's mark, which publishes it, its renewal, which stamps its
-- slots, or the reaper, which returns it); waiting for it could deadlock
-- with that mark (the rows locked in another order), and PostgreSQL then
-- ended one of the two (a .ci/run's backlog test: the mark, and its rows
-- stayed claimed for their lease).
WITH slots AS (
    UPDATE outbox_relay_partitions p
       SET owner_pid = pg_backend_pid()
      FROM (SELECT slot
              FROM outbox_relay_partitions
             WHERE owner_pid = ANY(@past_pids::int[])
               FOR UPDATE SKIP LOCKED) s
     WHERE p.slot = s.slot
), claims AS MATERIALIZED (
    SELECT id, coalesce(claim_token = ANY(@tokens::uuid[]), false) AS known
      FROM outbox_messages
     WHERE unpublished
       AND status = 'publishing'
       AND (claimed_pid = ANY(@past_pids::int[]) OR claimed_pid IS NULL AND claimed_by = @relay)
       FOR UPDATE SKIP LOCKED
)
UPDATE outbox_messages o
   SET claimed_pid = CASE WHEN c.known THEN pg_backend_pid()
                          ELSE coalesce((@past_pids::int[])[cardinality(@past_pids::int[])], -1) END
  FROM claims c
 WHERE o.id = c.id
   AND (c.known OR o.claimed_pid IS NULL AND o.claim_token IS NOT NULL)
