-- The notify trigger fires BEFORE the inserting statement, not after it
-- (for the writers' throughput at 32 clients, notify idle against off).
--
-- An AFTER trigger, even a statement-level one, goes through PostgreSQL's
-- after-trigger queue: the statement's event is saved, and the function runs
-- from the queue when the statement ends. A BEFORE statement trigger runs at
-- once. `outbox bench writers --writers 32 --modes off,idle`, three rounds
-- alternating with the AFTER trigger of 0013: 0.949-0.956 of notify off
-- against 0.878-0.911 (docs/log.md).
--
-- The protocol is unchanged (0006, 0013). It does not depend on when in its
-- transaction a writer reads the flag, only that the shared lock, when
-- taken, is held until the transaction ends, and that the rows become
-- visible at commit, never before: a relay that sets the flag and then
-- takes the lock exclusively still claims after every writer that read 0
-- twice has committed or rolled back, and a NOTIFY is still sent only at
-- commit, wherever in the transaction pg_notify was called. A statement
-- that fails after the trigger ran takes its lock and its NOTIFY with it
-- (its transaction, or its subtransaction, is rolled back), as it did with
-- the AFTER trigger, which did not run at all then.
--
-- One difference: a writer that reads 0 holds the shared lock through its
-- own INSERT (or COPY) as well, not only from the statement's end to its
-- commit. A relay going to sleep then waits for a long bulk load as it
-- waited for a long transaction: it stays awake and tries again (0006).
--
-- outbox_notify_mode creates the trigger BEFORE from now on, and re-creates
-- one that is not (a trigger of an earlier version, or made by hand) when
-- asked for its mode. This migration re-creates the trigger BEFORE in the
-- mode the database is in (a database in notify mode always or off stays
-- in it), with its enabled state (DISABLE, ENABLE REPLICA or ALWAYS); a
-- trigger of that name on another function is left as it is, with a notice.
--
-- Re-creating the trigger locks outbox_messages (ACCESS EXCLUSIVE) for an
-- instant, after every transaction that uses the table ends: writers and
-- relays queue behind the migration meanwhile. It gives up after 5 s
-- (lock_timeout) rather than stall them behind a long transaction; run it
-- again when that one has ended.
SET LOCAL lock_timeout = '5s';

CREATE OR REPLACE FUNCTION outbox_notify_mode(mode text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    previous text;
    before_statement boolean;
BEGIN
    SELECT CASE p.proname
               WHEN 'outbox_messages_notify_idle' THEN 'idle'
               WHEN 'outbox_messages_notify' THEN 'always'
           END,
           -- tgtype: bit 0 FOR EACH ROW, bit 1 BEFORE
           t.tgtype & 3 = 2
      INTO previous, before_statement
      FROM pg_trigger t
      JOIN pg_proc p ON p.oid = t.tgfoid
     WHERE t.tgrelid = 'outbox_messages'::regclass
       AND t.tgname = 'outbox_messages_notify';
    IF mode IS NULL OR mode NOT IN ('idle', 'always', 'off') THEN
        RAISE EXCEPTION 'outbox_notify_mode: unknown mode %; want idle, always or off', mode
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF previous IS NOT DISTINCT FROM NULLIF(mode, 'off') AND (previous IS NULL OR before_statement) THEN
        RETURN coalesce(previous, 'off');
    END IF;
    DROP TRIGGER IF EXISTS outbox_messages_notify ON outbox_messages;
    IF mode = 'idle' THEN
        CREATE TRIGGER outbox_messages_notify BEFORE INSERT ON outbox_messages
            FOR EACH STATEMENT EXECUTE FUNCTION outbox_messages_notify_idle();
    ELSIF mode = 'always' THEN
        CREATE TRIGGER outbox_messages_notify BEFORE INSERT ON outbox_messages
            FOR EACH STATEMENT EXECUTE FUNCTION outbox_messages_notify();
    END IF;
    -- A relay may be asleep with the flag at 0 (it was set while the trigger
    -- did not read it); waking it once is harmless.
    PERFORM setval('outbox_relay_idle', 1);
    RETURN coalesce(previous, 'off');
END
$$;

DO $$
DECLARE
    fn text;
    enabled "char";
BEGIN
    SELECT p.proname, t.tgenabled INTO fn, enabled
      FROM pg_trigger t
      JOIN pg_proc p ON p.oid = t.tgfoid
     WHERE t.tgrelid = 'outbox_messages'::regclass
       AND t.tgname = 'outbox_messages_notify';
    IF fn IS NULL THEN
        RETURN; -- notify mode off
    END IF;
    IF fn NOT IN ('outbox_messages_notify_idle', 'outbox_messages_notify') THEN
        RAISE NOTICE 'outbox_messages_notify runs %(), not an outbox notify function: left as it is', fn;
        RETURN;
    END IF;
    DROP TRIGGER outbox_messages_notify ON outbox_messages;
    EXECUTE format('CREATE TRIGGER outbox_messages_notify BEFORE INSERT ON outbox_messages
                        FOR EACH STATEMENT EXECUTE FUNCTION %I()', fn);
    -- O: enabled (the default); D: disabled; R: replica only; A: always.
    IF enabled = 'D' THEN
        ALTER TABLE outbox_messages DISABLE TRIGGER outbox_messages_notify;
    ELSIF enabled = 'R' THEN
        ALTER TABLE outbox_messages ENABLE REPLICA TRIGGER outbox_messages_notify;
    ELSIF enabled = 'A' THEN
        ALTER TABLE outbox_messages ENABLE ALWAYS TRIGGER outbox_messages_notify;
    END IF;
END
$$;
