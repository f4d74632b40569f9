-- The notify trigger fires BEFORE the inserting statement, not after it
-- (issue 26: writers at 32 clients, notify idle against off).
--
-- An AFTER trigger, even a statement-level one, goes through PostgreSQL's
-- after-trigger queue: the statement's event is saved, and the function runs
-- from the queue when the statement ends. A BEFORE statement trigger runs at
-- once. `outbox bench writers --writers 32 --modes off,idle`, three rounds
-- alternating with the AFTER trigger of 0013: 0.949-0.956 of notify off
-- against 0.878-0.911 (docs/log.md, 2026-12-05 afternoon).
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
-- outbox_notify_mode creates the trigger BEFORE from now on, and the
-- trigger there is re-created BEFORE in the mode it is in (a database in
-- notify mode always or off stays in it).
CREATE OR REPLACE FUNCTION outbox_notify_mode(mode text) RETURNS text
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
BEGIN
    SELECT p.proname INTO fn
      FROM pg_trigger t
      JOIN pg_proc p ON p.oid = t.tgfoid
     WHERE t.tgrelid = 'outbox_messages'::regclass
       AND t.tgname = 'outbox_messages_notify';
    IF fn IS NOT NULL THEN
        DROP TRIGGER outbox_messages_notify ON outbox_messages;
        EXECUTE format('CREATE TRIGGER outbox_messages_notify BEFORE INSERT ON outbox_messages
                            FOR EACH STATEMENT EXECUTE FUNCTION %I()', fn);
    END IF;
END
$$;
