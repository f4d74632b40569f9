-- Partition leases for relays (relay.Config.Ownership = "partitions").
--
-- A relay that owns rows claims each one (relay_claim.sql: a heap update per
-- row, then the mark's second one, and a per-key probe that keeps order). A
-- relay that owns partitions instead leases whole slots of partition keys
-- here, reads its slots' rows in seq order without locking or updating them
-- (relay_read.sql), and marks them published only while its lease's token is
-- still the slot's (relay_mark_published_leased.sql): one heap update per
-- event instead of two, and no probe.
--
-- A slot is outbox_relay_slot(partition key, number of slots): the first four
-- bytes of the key's MD5 as an unsigned number, modulo the number of rows in
-- outbox_relay_partitions; the same function as partition.Of in Go. Every
-- event of one partition key is in one slot, so one relay at a time publishes
-- it, in seq order. The number of slots is fixed by the rows below: changing
-- it moves keys between slots, so stop every relay (or drain) first.
CREATE TABLE outbox_relay_partitions (
    slot        int PRIMARY KEY CHECK (slot >= 0),
    owner       text,             -- the relay's instance name, NULL when free
    token       uuid,             -- fencing token, new at every acquisition
    lease_until timestamptz NOT NULL DEFAULT '-infinity'
);
INSERT INTO outbox_relay_partitions (slot) SELECT generate_series(0, 15);

-- The relays alive, so that each takes its share of the slots: a relay's row
-- is renewed with its leases and expires with them.
CREATE TABLE outbox_relay_members (
    owner      text PRIMARY KEY,
    seen_until timestamptz NOT NULL
);

CREATE FUNCTION outbox_relay_slot(key text, slots int) RETURNS int
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    AS $$ SELECT (('x' || substr(md5(key), 1, 8))::bit(32)::bigint % greatest(slots, 1))::int $$;

-- Order under retries without the claim's probe: an event whose publish
-- failed waits for its backoff as pending with attempts > 0, and the events
-- after it with the same partition key must wait too. This index holds only
-- those events (usually none), so the read's anti-join against it costs
-- almost nothing. (Dead events are not unpublished: the events after a dead
-- one go on, as with row claims; docs/design.md.)
CREATE INDEX outbox_messages_retrying
    ON outbox_messages (aggregate_type, (coalesce(partition_key, aggregate_id)), seq)
    WHERE unpublished AND attempts > 0;
