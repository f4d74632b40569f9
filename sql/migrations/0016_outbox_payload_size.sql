-- Big payloads: a size the relays can batch by, and a limit.
--
-- The relays bound a batch by payload bytes as well as rows
-- (relay.Config.BatchBytes; relay_claim.sql, relay_read.sql). Reading the
-- bytes of a stored payload costs nothing for a small one (pg_column_size:
-- its stored size, at most 8 kB raw below the TOAST threshold) but, for a
-- big compressed one, gives its compressed size, which can be a thousandth
-- of what the relay reads and publishes. So a big payload's raw size is kept
-- when it is written: payload_bytes, set by a BEFORE INSERT row trigger
-- whose WHEN clause (the in-memory size of the new payload, raw before
-- TOAST compresses it) calls it only for payloads over 8 kB. NULL on every
-- other row, and on the rows written before this migration.
--
-- A payload over 16 MiB (raw, as written) is refused where it is written:
-- outbox_messages_payload_size checks payload_bytes, which the trigger sets
-- before the check runs. It is on payload_bytes, not on the payload itself,
-- so that the rows written before this migration (payload_bytes NULL) pass
-- every later UPDATE of the relays whatever their size: a check on the
-- payload would refuse the claim of an old big row, and with it the whole
-- batch. NOT VALID: validating would read the whole table. A Redis stream
-- entry of that size is already at the edge of what a consumer should read
-- in a batch; carry a reference to the data instead.
--
-- Adding a nullable column and a NOT VALID constraint is instant; like 0014
-- and 0015 the migration gives up after 5 s behind a long transaction on the
-- table rather than queue every writer behind it.
SET LOCAL lock_timeout = '5s';

ALTER TABLE outbox_messages ADD COLUMN payload_bytes integer;

ALTER TABLE outbox_messages ADD CONSTRAINT outbox_messages_payload_size
    CHECK (payload_bytes IS NULL OR payload_bytes <= 16777216) NOT VALID;

CREATE FUNCTION outbox_messages_payload_bytes() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    NEW.payload_bytes := pg_column_size(NEW.payload);
    RETURN NEW;
END
$$;

CREATE TRIGGER outbox_messages_payload_bytes BEFORE INSERT ON outbox_messages
    FOR EACH ROW
    WHEN (pg_column_size(NEW.payload) > 8192)
    EXECUTE FUNCTION outbox_messages_payload_bytes();
