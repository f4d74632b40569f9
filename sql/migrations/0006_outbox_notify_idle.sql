-- Notify only when a relay sleeps.
--
-- 0003 notified on every inserting statement. PostgreSQL serializes the
-- commits of notifying transactions (a cluster-wide lock held through the
-- commit record's flush), so under load writers queue behind one another just
-- to announce rows that a busy relay would find anyway. A relay that is
-- draining does not need wake-ups: it keeps claiming until a claim comes back
-- empty. So the trigger notifies only while a relay is idle.
--
-- The idle flag is a sequence: reading and setting it is not transactional, so
-- a writer sees the relay's latest word whatever its isolation level, and a
-- relay's change needs no commit. 1 = some relay sleeps and waits for a NOTIFY;
-- 0 = relays are draining.
--
-- The race, and how it is closed. A writer reads the flag when it inserts
-- outbox rows (a statement-level trigger); a relay going to sleep sets the flag
-- and then claims once more. A writer that read 0 but has not committed yet
-- would be invisible to that last claim and would not notify either. So a
-- writer that reads 0 takes a shared advisory lock, held until its
-- transaction ends, and reads the flag again; the relay, after setting the
-- flag, takes the same lock exclusively (outbox_relay_sleep).
-- The relay thus claims for the last time only after every writer that read 0
-- twice has committed or rolled back; a writer that asks for the lock later
-- reads 1 the second time and notifies. Writers that read 1 notify at once and
-- never touch the lock. The relay waits for the lock at most 20 ms (a writer
-- that saw it busy may run a long transaction after its insert); if it cannot
-- have it, outbox_relay_sleep returns false and the relay claims again a
-- little later instead of sleeping.
--
-- Why not a deferred constraint trigger, reading the flag at commit: with
-- 32 writers on 2 cores an empty deferred row trigger alone cost about a
-- quarter of the settle throughput, an empty statement trigger next to
-- nothing (pgbench, docs/benchmarks.md).

-- outbox_notify_mode switches mechanism: 'idle' (this one, the default),
-- 'always' (0003's trigger) or 'off' (no trigger; the relay's fallback poll
-- alone finds new rows). The relay works the same under every mode.

CREATE SEQUENCE outbox_relay_idle AS smallint MINVALUE 0 MAXVALUE 1 START 1 NO CYCLE;

CREATE FUNCTION outbox_messages_notify_idle() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- Once per transaction, whatever the number of statements that insert.
    IF current_setting('outbox.notify_checked', true) = 'on' THEN
        RETURN NULL;
    END IF;
    PERFORM set_config('outbox.notify_checked', 'on', true);
    IF (SELECT last_value FROM outbox_relay_idle) = 0 THEN
        PERFORM pg_advisory_xact_lock_shared(1869903214, 1);
        IF (SELECT last_value FROM outbox_relay_idle) = 0 THEN
            RETURN NULL; -- a relay is draining and will see this row
        END IF;
    END IF;
    PERFORM pg_notify('outbox_messages', '');
    RETURN NULL;
END
$$;

-- Called by a relay before its last claim ahead of sleeping: asks writers to
-- notify, then waits (20 ms at most) for every writer that read the flag as 0
-- to finish. Returns false if some still has not: the relay must not sleep yet.
--
-- The lock is transaction-scoped on purpose: the relay holds it until the end
-- of its round trip (the claim that follows), and no error can leave it held.
-- A session lock could leak: lock_timeout can fire just after the lock was
-- granted, and the error would skip the unlock (found by the benchmarks: every
-- writer then waited on a relay's idle connection).
CREATE FUNCTION outbox_relay_sleep() RETURNS boolean
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
        RETURN false;
    END;
    PERFORM set_config('lock_timeout', saved, true);
    RETURN true;
END
$$;

-- Called by a relay that starts draining: writers stop notifying.
CREATE FUNCTION outbox_relay_busy() RETURNS void
LANGUAGE sql AS $$
    SELECT setval('outbox_relay_idle', 0);
$$;

CREATE FUNCTION outbox_notify_mode(mode text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    previous text;
BEGIN
    SELECT CASE p.proname
               WHEN 'outbox_messages_notify_idle' THEN 'idle'
               WHEN 'outbox_messages_notify' THEN 'always'
           END
      INTO previous
      FROM pg_trigger t
      JOIN pg_proc p ON p.oid = t.tgfoid
     WHERE t.tgrelid = 'outbox_messages'::regclass
       AND t.tgname = 'outbox_messages_notify';
    IF mode IS NULL OR mode NOT IN ('idle', 'always', 'off') THEN
        RAISE EXCEPTION 'outbox_notify_mode: unknown mode %; want idle, always or off', mode
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF previous IS NOT DISTINCT FROM NULLIF(mode, 'off') THEN
        RETURN coalesce(previous, 'off');
    END IF;
    DROP TRIGGER IF EXISTS outbox_messages_notify ON outbox_messages;
    IF mode = 'idle' THEN
        CREATE TRIGGER outbox_messages_notify AFTER INSERT ON outbox_messages
            FOR EACH STATEMENT EXECUTE FUNCTION outbox_messages_notify_idle();
    ELSIF mode = 'always' THEN
        CREATE TRIGGER outbox_messages_notify AFTER INSERT ON outbox_messages
            FOR EACH STATEMENT EXECUTE FUNCTION outbox_messages_notify();
    END IF;
    -- A relay may be asleep with the flag at 0 (it was set while the trigger
    -- did not read it); waking it once is harmless.
    PERFORM setval('outbox_relay_idle', 1);
    RETURN coalesce(previous, 'off');
END
$$;

SELECT outbox_notify_mode('idle');
