-- The transactional outbox. A row is written in the same transaction as the
-- business change it describes; the relay publishes it afterwards.
--
-- Only aggregate_type, aggregate_id, event_type and payload are required: every
-- other column has a working default, so other services and scripts can insert
-- rows with a plain INSERT.
CREATE SEQUENCE outbox_messages_seq AS bigint;

CREATE TABLE outbox_messages (
    -- The event id, sent to consumers as event_id; they deduplicate on it.
    id              uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    -- Monotonic publication order. Assigned by the outbox_messages_order
    -- trigger while holding a per-aggregate lock, so that for one aggregate
    -- seq order is also commit order.
    seq             bigint      NOT NULL DEFAULT nextval('outbox_messages_seq'),
    aggregate_type  text        NOT NULL,
    aggregate_id    text        NOT NULL,
    event_type      text        NOT NULL,
    payload         jsonb       NOT NULL,
    headers         jsonb       NOT NULL DEFAULT '{}'::jsonb,
    status          text        NOT NULL DEFAULT 'pending',
    -- Failed publish attempts (publish errors and expired leases).
    attempts        integer     NOT NULL DEFAULT 0,
    -- The lease: when and by whom the row was claimed, and the fencing token
    -- every follow-up write must present.
    claimed_at      timestamptz,
    claimed_by      text,
    claim_token     uuid,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    published_at    timestamptz,
    -- The Redis stream entry id of the (last) successful publish.
    stream_id       text,
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT outbox_messages_seq_unique UNIQUE (seq),
    CONSTRAINT outbox_messages_status_valid
        CHECK (status IN ('pending', 'publishing', 'published', 'dead')),
    CONSTRAINT outbox_messages_aggregate_type_set CHECK (aggregate_type ~ '^[A-Za-z0-9_.-]{1,100}$'),
    CONSTRAINT outbox_messages_aggregate_id_set   CHECK (length(aggregate_id) BETWEEN 1 AND 200),
    CONSTRAINT outbox_messages_event_type_set     CHECK (length(event_type) BETWEEN 1 AND 200),
    CONSTRAINT outbox_messages_attempts_valid     CHECK (attempts >= 0),
    CONSTRAINT outbox_messages_claim_consistent
        CHECK ((status = 'publishing') = (claim_token IS NOT NULL)
               AND (status <> 'publishing' OR claimed_at IS NOT NULL)),
    CONSTRAINT outbox_messages_published_consistent
        CHECK ((status = 'published') = (published_at IS NOT NULL))
);
ALTER SEQUENCE outbox_messages_seq OWNED BY outbox_messages.seq;

-- Claimable rows only: stays small however many published rows accumulate.
CREATE INDEX outbox_messages_unpublished ON outbox_messages (seq)
    WHERE status IN ('pending', 'publishing');

-- Per-aggregate order gate: "is an older event of this aggregate unpublished?"
CREATE INDEX outbox_messages_unpublished_by_aggregate
    ON outbox_messages (aggregate_type, aggregate_id, seq)
    WHERE status IN ('pending', 'publishing');

-- Serialize writers of one aggregate and assign seq under that lock, so that an
-- event can never become visible before an older event of the same aggregate.
-- Like row locks, these are taken in insertion order: a transaction that writes
-- events for several aggregates should write them in a consistent order
-- (outbox.Write sorts the messages of one call for that reason).
-- The lock is transaction-scoped and keyed by (class, hash); the two-key form
-- does not collide with single-key advisory locks an application may use.
CREATE FUNCTION outbox_messages_order() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(1869903224, hashtext(NEW.aggregate_type || '/' || NEW.aggregate_id));
    NEW.seq := nextval('outbox_messages_seq');
    RETURN NEW;
END
$$;

CREATE TRIGGER outbox_messages_order BEFORE INSERT ON outbox_messages
    FOR EACH ROW EXECUTE FUNCTION outbox_messages_order();

-- The table is a queue: rows are inserted, updated twice and deleted. Vacuum it
-- eagerly so dead tuples do not pile up at the head of the claim index.
ALTER TABLE outbox_messages SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 10000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 1000
);
