-- The relays' advisory locks, taken by another role, do no harm.
--
-- PostgreSQL grants its advisory lock functions to every role and has no
-- grant for one lock key: a writer's session (or any other) can take the
-- locks the relays rely on and keep them. It could:
--
--   - hold the wake-up lock (1869903214, migration 0006) exclusively: every
--     writer that read "busy" then waited for it, without end;
--   - hold it shared, idle: a relay going to sleep could never take it
--     exclusively, and stayed awake, claiming ten times a second;
--   - hold an ownership lock (1869903216, migration 0012): the relays took
--     that session for a live relay of that ownership, refused to start next
--     to it ("relays of both ownerships"), and, it being idle, for a stalled
--     relay to terminate.
--
-- So:
--
--   - a writer that read "busy" tries the wake-up lock instead of waiting
--     for it, and notifies when it cannot have it. The protocol holds: a
--     writer either holds the lock before the relay asks for it (the relay
--     waits for its commit) or notifies. While a relay asks for the lock
--     (20 ms at most) it has said "sleep" already, and the writer would have
--     notified anyway;
--   - a relay that cannot take it within 20 ms looks at who holds it
--     (pg_locks): only a backend in a transaction can be a writer that read
--     "busy" (its lock is transaction-scoped). A session-level lock held
--     outside any transaction keeps no relay awake. A holder with no pid (a
--     prepared transaction) counts as a writer. A backend is in a
--     transaction exactly while it holds its own virtualxid lock, which
--     pg_locks shows to every role (pg_stat_activity hides other roles'
--     state);
--   - a live relay is a backend holding an ownership lock and registered in
--     outbox_relay_members (relay_register.sql), which only the relays' role
--     may write. A relay registers before it looks for the other ownership's
--     relays (relay/listen.go), so two relays of different ownerships
--     starting at once still see each other: each registers, then looks.
--
-- The writers' per-key lock slots (1869903215) are the writers' own: a
-- session holding one keeps the writers of that slot waiting, as a writer's
-- long transaction does; no relay depends on it.

CREATE OR REPLACE FUNCTION outbox_messages_notify_idle() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF pg_sequence_last_value('outbox_relay_idle') = 0
       AND pg_try_advisory_xact_lock_shared(1869903214, 1)
       AND pg_sequence_last_value('outbox_relay_idle') = 0 THEN
        RETURN NULL; -- a relay is draining and will see this row
    END IF;
    PERFORM pg_notify('outbox_messages', '');
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION outbox_relay_sleep() RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    saved text := current_setting('lock_timeout');
BEGIN
    PERFORM setval('outbox_relay_idle', 1);
    PERFORM set_config('lock_timeout', '20ms', true);
    BEGIN
        PERFORM pg_advisory_xact_lock(1869903214, 1);
    EXCEPTION WHEN lock_not_available THEN
        PERFORM set_config('lock_timeout', saved, true);
        -- One read of the lock table (MATERIALIZED: pg_locks twice would
        -- be two reads).
        RETURN NOT EXISTS (
            WITH locks AS MATERIALIZED (
                SELECT locktype, database, classid, objid, objsubid, pid, granted, virtualxid
                  FROM pg_locks
            )
            SELECT 1
              FROM locks h
             WHERE h.locktype = 'advisory'
               AND h.database = (SELECT oid FROM pg_database WHERE datname = current_database())
               AND h.classid = 1869903214 AND h.objid = 1 AND h.objsubid = 2
               AND h.granted
               AND h.pid IS DISTINCT FROM pg_backend_pid()
               AND (h.pid IS NULL
                    OR EXISTS (SELECT 1 FROM locks x
                                WHERE x.locktype = 'virtualxid' AND x.pid = h.pid AND x.granted)));
    END;
    PERFORM set_config('lock_timeout', saved, true);
    RETURN true;
END
$$;

CREATE OR REPLACE VIEW outbox_live_relays AS
SELECT l.pid, l.objid::int AS ownership
  FROM pg_locks l
 WHERE l.locktype = 'advisory'
   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND l.classid = 1869903216
   AND l.objsubid = 2
   AND l.granted
   AND l.pid IN (SELECT m.pid FROM outbox_relay_members m WHERE m.pid IS NOT NULL);
