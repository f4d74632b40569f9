-- Every transfer.settled row is keyed by its sender, whoever wrote it.
--
-- Anti-fraud judges a sender's TEDs in one partition, the one its account
-- hashes to, in settled order; transfer.Settle writes partition_key = the
-- sender for that. A service settling TEDs with plain SQL, as the README
-- allows, writes no partition_key: the relays then routed the row by its
-- aggregate id (the transfer id) to another partition's stream, where
-- anti-fraud kept it pending forever. This trigger fills the key in from the
-- payload's from_account, before the row is written, so that such a row is
-- routed as transfer.Settle's are.
--
-- Keyed in commit order, too. The relays publish a key's events in seq
-- order, which is commit order only when two transactions writing one key
-- take their seq one after the other: outbox.Write takes the key's lock
-- slot (class 1869903215, sql/queries/outbox_lock_partitions.sql) before its
-- insert for that. A plain INSERT does not, so the trigger takes the same
-- slot's lock and then draws the row's seq again (the default drew one
-- before the trigger ran, unlocked): a second transaction settling a TED of
-- the same sender waits here until the first has committed or rolled back,
-- and its seq is the later one. A multi-row INSERT of several senders takes
-- their slots in row order, so two of them can deadlock (PostgreSQL aborts
-- one; retry it) where outbox.Write, taking its slots in ascending order,
-- cannot.
--
-- Filled in, not refused: a settlement must not fail for want of a routing
-- key the database can derive. A key the writer set is kept (a wrong one is
-- dead-lettered by anti-fraud as invalid, with the reason); a payload with
-- no from_account leaves it NULL (anti-fraud dead-letters the payload).
--
-- Row-level, but only for the rows it changes: the WHEN clause is evaluated
-- on each inserted row without calling the function, so transfer.Settle's
-- rows (keyed already) and other event types pay a comparison, not a
-- PL/pgSQL call.
--
-- Creating the trigger locks outbox_messages for an instant, after every
-- transaction that uses the table ends; like 0014 it gives up after 5 s
-- behind a long one rather than queue every writer behind it.
SET LOCAL lock_timeout = '5s';

CREATE FUNCTION outbox_messages_key_settled() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
DECLARE
    sender text := NEW.payload->>'from_account';
BEGIN
    -- Only a key the table accepts (outbox_messages_partition_key_set): an
    -- account anti-fraud would refuse anyway must not fail the settlement.
    IF length(sender) BETWEEN 1 AND 200 THEN
        NEW.partition_key := sender;
        PERFORM pg_advisory_xact_lock(1869903215, outbox_relay_slot(NEW.aggregate_type || '/' || sender, 256));
        NEW.seq := nextval('outbox_messages_seq');
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER outbox_messages_key_settled BEFORE INSERT ON outbox_messages
    FOR EACH ROW
    WHEN (NEW.partition_key IS NULL AND NEW.event_type = 'transfer.settled')
    EXECUTE FUNCTION outbox_messages_key_settled();
