-- Wake the relay when outbox rows are committed. NOTIFY is delivered only if
-- the transaction commits, and only to sessions listening at that moment, so
-- it is a latency hint: the relay's fallback poll is what guarantees delivery.
--
-- Statement-level, constant payload: one notification per inserting statement
-- (folded to one per transaction), never the event itself (payloads are capped
-- at 8000 bytes and would fail the business transaction).
--
-- Cost: PostgreSQL serializes the commits of all transactions that notified
-- (a cluster-wide lock held through commit). To change the mechanism, replace
-- this function or drop the trigger: the relay still polls.
CREATE FUNCTION outbox_messages_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_messages', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER outbox_messages_notify AFTER INSERT ON outbox_messages
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_messages_notify();
