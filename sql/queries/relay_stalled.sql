-- Terminate the LISTEN backends of the relays among @pids that are still
-- stalled (relay_watch.sql: idle for more than @stall_ms milliseconds, checked
-- again here, so that a relay that woke up in between is left alone), waiting
-- up to a second for each to exit: its lock is then released and the caller
-- takes its work over as a dead relay's (relay_bury.sql, relay_reap.sql).
-- Returns the names (from the relays' memberships) and pids terminated.
SELECT coalesce(m.owner, '') AS relay, a.pid
  FROM pg_stat_activity a
  LEFT JOIN outbox_relay_members m ON m.pid = a.pid
 WHERE a.pid = ANY (@pids::int[])
   AND a.pid IN (SELECT pid FROM outbox_live_relays)
   AND a.state = 'idle'
   AND a.state_change < now() - @stall_ms * interval '1 millisecond'
   AND pg_terminate_backend(a.pid, 1000)
