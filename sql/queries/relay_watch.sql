-- What a relay looks at several times a second, on its LISTEN connection
-- (migration 0012): whether a relay died (its membership's backend holds no
-- lock any more), whether writers are silent because of a relay that is
-- gone (the idle flag says "busy" and the relay that said it last is not
-- alive), and which live relays stalled: their LISTEN backend, which every
-- relay's watch makes answer a query four times a second, has been idle for
-- more than @stall_ms milliseconds (a process stopped, paused or swapped
-- out, or a link gone quiet, with its connections left open). The caller
-- terminates a stalled relay's LISTEN backend (relay_stalled.sql), which
-- releases its lock: it is then dead to every relay, and its claims, slots
-- and "busy" word are taken over as a dead relay's. All of it is read from
-- memory: no table but the members' is touched.
SELECT EXISTS (SELECT 1
                 FROM outbox_relay_members m
                WHERE m.pid IS NOT NULL
                  AND m.pid NOT IN (SELECT pid FROM outbox_live_relays)) AS dead,
       (SELECT last_value FROM outbox_relay_idle) = 0
       AND (SELECT last_value FROM outbox_relay_busy_pid) NOT IN (SELECT pid FROM outbox_live_relays) AS silenced,
       coalesce((SELECT array_agg(a.pid)
                   FROM pg_stat_activity a
                  WHERE a.pid IN (SELECT pid FROM outbox_live_relays)
                    AND a.pid <> pg_backend_pid()
                    AND a.state = 'idle'
                    AND a.state_change < now() - @stall_ms * interval '1 millisecond'), '{}')::int[] AS stalled
