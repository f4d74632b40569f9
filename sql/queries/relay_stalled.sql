-- Terminate the LISTEN backends of the relays among @pids that are still
-- stalled (relay_watch.sql: idle for more than @stall_ms milliseconds, checked
-- again here, so that a relay that woke up in between is left alone), waiting
-- up to a second for each to exit: its lock is then released and the caller
-- takes its work over as a dead relay's (relay_bury.sql, relay_reap.sql).
-- Returns the names (from the relays' memberships) and pids terminated.
--
-- Both steps are MATERIALIZED CTEs: PostgreSQL orders the conditions of one
-- WHERE clause by their cost, not as written, and pg_terminate_backend is
-- among the cheapest; in a single WHERE it could run before the conditions
-- and terminate backends that are neither stalled nor relays.
WITH stalled AS MATERIALIZED (
    SELECT a.pid
      FROM pg_stat_activity a
     WHERE a.pid = ANY (@pids::int[])
       AND a.pid IN (SELECT pid FROM outbox_live_relays)
       AND a.pid <> pg_backend_pid()
       AND a.state = 'idle'
       AND a.state_change < now() - @stall_ms * interval '1 millisecond'
), terminated AS MATERIALIZED (
    SELECT s.pid, pg_terminate_backend(s.pid, 1000) AS done
      FROM stalled s
)
SELECT coalesce((SELECT m.owner FROM outbox_relay_members m WHERE m.pid = t.pid LIMIT 1), '') AS relay, t.pid
  FROM terminated t
 WHERE t.done
