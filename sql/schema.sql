-- The outbox's schema as the migrations (sql/migrations) build it, in one
-- place, to read. Generated: go test ./internal/migrate -run TestSchemaSnapshot
-- -update (pg_dump); the test fails when it no longer matches the migrations.
-- Apply the migrations, not this file: they also insert the relay's 16
-- partition slots and set the wake-up flag, and record their versions.

-- Function bodies refer to tables created further down.
SET check_function_bodies = false;

-- SCHEMA public

CREATE SCHEMA public;

-- FUNCTION outbox_messages_key_settled()

CREATE FUNCTION public.outbox_messages_key_settled() RETURNS trigger
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

-- FUNCTION outbox_messages_notify()

CREATE FUNCTION public.outbox_messages_notify() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    PERFORM pg_notify('outbox_messages', '');
    RETURN NULL;
END
$$;

-- FUNCTION outbox_messages_notify_idle()

CREATE FUNCTION public.outbox_messages_notify_idle() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
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

-- FUNCTION outbox_messages_payload_bytes()

CREATE FUNCTION public.outbox_messages_payload_bytes() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    NEW.payload_bytes := pg_column_size(NEW.payload);
    RETURN NEW;
END
$$;

-- FUNCTION outbox_messages_requeued()

CREATE FUNCTION public.outbox_messages_requeued() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    PERFORM nextval('outbox_relay_requeues');
    RETURN NULL;
END
$$;

-- FUNCTION outbox_notify_mode(text)

CREATE FUNCTION public.outbox_notify_mode(mode text) RETURNS text
    LANGUAGE plpgsql
    AS $$
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

-- FUNCTION outbox_relay_busy()

CREATE FUNCTION public.outbox_relay_busy() RETURNS void
    LANGUAGE sql
    AS $$
    SELECT setval('outbox_relay_idle', 0);
$$;

-- FUNCTION outbox_relay_busy(integer)

CREATE FUNCTION public.outbox_relay_busy(relay_pid integer) RETURNS void
    LANGUAGE sql
    AS $$
    SELECT setval('outbox_relay_busy_pid', greatest(relay_pid, 0));
    SELECT setval('outbox_relay_idle', 0);
$$;

-- FUNCTION outbox_relay_floor(bigint, bigint, text[], bigint, text[], bigint, boolean)

CREATE FUNCTION public.outbox_relay_floor(INOUT floor_seq bigint, INOUT mark bigint, INOUT writers text[], INOUT hole bigint, INOUT hole_writers text[], INOUT requeues bigint, force boolean, OUT taken boolean) RETURNS record
    LANGUAGE plpgsql
    AS $$
DECLARE
    -- In this order: the sequence's last value before the writers are
    -- read, so that a writer that drew a value up to it is among them.
    seen bigint := coalesce(pg_sequence_last_value('outbox_relay_requeues'), 0);
    last bigint := pg_sequence_last_value('outbox_messages_seq');
    now_open text[] := outbox_relay_writers();
    open text[];
    lowest bigint;
BEGIN
    floor_seq := coalesce(floor_seq, 0);
    taken := false;
    IF requeues IS DISTINCT FROM seen THEN
        floor_seq := 0; mark := NULL; writers := NULL; hole := NULL; hole_writers := NULL;
        requeues := seen;
    END IF;
    IF hole IS NOT NULL AND NOT (hole_writers && now_open) THEN
        -- The writers passed over have ended: their rows are visible.
        floor_seq := least(floor_seq, hole);
        hole := NULL; hole_writers := NULL;
    END IF;
    IF mark IS NOT NULL THEN
        open := ARRAY(SELECT w FROM unnest(writers) w WHERE w = ANY(now_open));
        IF cardinality(open) = 0 OR force THEN
            IF cardinality(open) > 0 THEN
                hole := least(hole, floor_seq);
                hole_writers := coalesce(hole_writers, '{}') || open;
            END IF;
            -- A statement of its own, so a snapshot taken after the
            -- writers were seen gone.
            -- ORDER BY ... LIMIT 1, not min(): the first entry of the
            -- index from the floor, whatever the statistics say.
            SELECT o.seq INTO lowest
              FROM outbox_messages o
             WHERE o.unpublished
               AND o.seq >= floor_seq
             ORDER BY o.seq
             LIMIT 1;
            floor_seq := greatest(floor_seq, least(lowest, mark + 1));
            mark := NULL;
        END IF;
    END IF;
    IF mark IS NULL THEN
        -- The writers passed over already are the hole's.
        mark := last;
        writers := ARRAY(SELECT w FROM unnest(now_open) w WHERE w <> ALL(coalesce(hole_writers, '{}')));
        taken := true;
    END IF;
    PERFORM set_config('outbox.read_from', floor_seq::text, true),
            set_config('outbox.keys_from', least(floor_seq, hole)::text, true),
            set_config('outbox.requeues', requeues::text, true);
END
$$;

-- FUNCTION outbox_relay_keys_from()

CREATE FUNCTION public.outbox_relay_keys_from() RETURNS bigint
    LANGUAGE sql STABLE
    AS $$ SELECT outbox_relay_setting_from('outbox.keys_from') $$;

-- FUNCTION outbox_relay_read_from()

CREATE FUNCTION public.outbox_relay_read_from() RETURNS bigint
    LANGUAGE sql STABLE
    AS $$ SELECT outbox_relay_setting_from('outbox.read_from') $$;

-- FUNCTION outbox_relay_setting_from(text)

CREATE FUNCTION public.outbox_relay_setting_from(setting text) RETURNS bigint
    LANGUAGE sql STABLE
    AS $$
    SELECT CASE WHEN coalesce(pg_sequence_last_value('outbox_relay_requeues'), 0)::text
                     = current_setting('outbox.requeues', true)
                THEN coalesce(nullif(current_setting(setting, true), '')::bigint, 0)
                ELSE 0 END
$$;

-- FUNCTION outbox_relay_sleep()

CREATE FUNCTION public.outbox_relay_sleep() RETURNS boolean
    LANGUAGE plpgsql
    AS $$
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

-- FUNCTION outbox_relay_slot(text, integer)

CREATE FUNCTION public.outbox_relay_slot(key text, slots integer) RETURNS integer
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    AS $$ SELECT (('x' || substr(md5(key), 1, 8))::bit(32)::bigint % greatest(slots, 1))::int $$;

-- FUNCTION outbox_relay_writers()

CREATE FUNCTION public.outbox_relay_writers() RETURNS text[]
    LANGUAGE plpgsql
    AS $$
BEGIN
    RETURN ARRAY(SELECT DISTINCT l.virtualtransaction
                   FROM pg_locks l
                  WHERE l.locktype = 'relation'
                    AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                    AND l.relation = 'outbox_messages'::regclass
                    AND l.mode = 'RowExclusiveLock'
                    AND l.granted
                    AND l.pid IS DISTINCT FROM pg_backend_pid());
END
$$;

-- TABLE outbox_cleanups

CREATE TABLE public.outbox_cleanups (
    id bigint NOT NULL,
    ran_at timestamp with time zone DEFAULT now() NOT NULL,
    cutoff timestamp with time zone NOT NULL,
    deleted bigint DEFAULT 0 NOT NULL,
    CONSTRAINT outbox_cleanups_deleted_check CHECK ((deleted >= 0))
);

-- SEQUENCE outbox_cleanups_id_seq

ALTER TABLE public.outbox_cleanups ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME public.outbox_cleanups_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

-- TABLE outbox_relay_members

CREATE TABLE public.outbox_relay_members (
    owner text NOT NULL,
    seen_until timestamp with time zone NOT NULL,
    pid integer
);

-- VIEW outbox_live_relays

CREATE VIEW public.outbox_live_relays AS
 SELECT l.pid,
    (l.objid)::integer AS ownership
   FROM pg_locks l
  WHERE ((l.locktype = 'advisory'::text) AND (l.database = ( SELECT pg_database.oid
           FROM pg_database
          WHERE (pg_database.datname = current_database()))) AND (l.classid = (1869903216)::oid) AND (l.objsubid = 2) AND l.granted AND (l.pid IN ( SELECT m.pid
           FROM public.outbox_relay_members m
          WHERE (m.pid IS NOT NULL))));

-- TABLE outbox_messages

CREATE TABLE public.outbox_messages (
    id uuid DEFAULT gen_random_uuid() NOT NULL,
    seq bigint NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    event_type text NOT NULL,
    payload jsonb NOT NULL,
    headers jsonb DEFAULT '{}'::jsonb NOT NULL,
    status text DEFAULT 'pending'::text NOT NULL,
    attempts integer DEFAULT 0 NOT NULL,
    claimed_at timestamp with time zone,
    claimed_by text,
    claim_token uuid,
    next_attempt_at timestamp with time zone DEFAULT now() NOT NULL,
    published_at timestamp with time zone,
    stream_id text,
    last_error text,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    unpublished boolean GENERATED ALWAYS AS ((status = ANY (ARRAY['pending'::text, 'publishing'::text]))) STORED,
    dead boolean GENERATED ALWAYS AS ((status = 'dead'::text)) STORED,
    partition_key text,
    first_sent_at timestamp with time zone,
    claimed_pid integer,
    payload_bytes integer,
    CONSTRAINT outbox_messages_aggregate_id_set CHECK (((length(aggregate_id) >= 1) AND (length(aggregate_id) <= 200))),
    CONSTRAINT outbox_messages_aggregate_type_set CHECK ((aggregate_type ~ '^[A-Za-z0-9_.-]{1,100}$'::text)),
    CONSTRAINT outbox_messages_attempts_valid CHECK ((attempts >= 0)),
    CONSTRAINT outbox_messages_claim_consistent CHECK ((((status = 'publishing'::text) = (claim_token IS NOT NULL)) AND ((status <> 'publishing'::text) OR (claimed_at IS NOT NULL)))),
    CONSTRAINT outbox_messages_event_type_set CHECK (((length(event_type) >= 1) AND (length(event_type) <= 200))),
    CONSTRAINT outbox_messages_published_consistent CHECK (((status = 'published'::text) = (published_at IS NOT NULL))),
    CONSTRAINT outbox_messages_status_valid CHECK ((status = ANY (ARRAY['pending'::text, 'publishing'::text, 'published'::text, 'dead'::text])))
)
WITH (autovacuum_vacuum_scale_factor='0', autovacuum_vacuum_threshold='1000', autovacuum_vacuum_insert_scale_factor='0', autovacuum_vacuum_insert_threshold='10000', autovacuum_analyze_scale_factor='0', autovacuum_analyze_threshold='1000', fillfactor='50');

-- SEQUENCE outbox_messages_seq

CREATE SEQUENCE public.outbox_messages_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

-- SEQUENCE OWNED BY outbox_messages_seq

ALTER SEQUENCE public.outbox_messages_seq OWNED BY public.outbox_messages.seq;

-- TABLE outbox_operator_actions

CREATE TABLE public.outbox_operator_actions (
    id bigint NOT NULL,
    at timestamp with time zone DEFAULT now() NOT NULL,
    actor text NOT NULL,
    origin text DEFAULT ''::text NOT NULL,
    action text NOT NULL,
    target text NOT NULL,
    reason text NOT NULL,
    outcome text DEFAULT ''::text NOT NULL,
    CONSTRAINT outbox_operator_actions_action_check CHECK ((action = ANY (ARRAY['dead_retry'::text, 'dlq_retry'::text]))),
    CONSTRAINT outbox_operator_actions_actor_check CHECK (((length(actor) >= 1) AND (length(actor) <= 200))),
    CONSTRAINT outbox_operator_actions_origin_check CHECK ((length(origin) <= 200)),
    CONSTRAINT outbox_operator_actions_outcome_check CHECK ((length(outcome) <= 1000)),
    CONSTRAINT outbox_operator_actions_reason_check CHECK (((length(reason) >= 1) AND (length(reason) <= 1000))),
    CONSTRAINT outbox_operator_actions_target_check CHECK (((length(target) >= 1) AND (length(target) <= 500)))
);

-- SEQUENCE outbox_operator_actions_id_seq

ALTER TABLE public.outbox_operator_actions ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME public.outbox_operator_actions_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

-- SEQUENCE outbox_relay_busy_pid

CREATE SEQUENCE public.outbox_relay_busy_pid
    AS integer
    START WITH 0
    INCREMENT BY 1
    MINVALUE 0
    NO MAXVALUE
    CACHE 1;

-- SEQUENCE outbox_relay_idle

CREATE SEQUENCE public.outbox_relay_idle
    AS smallint
    START WITH 1
    INCREMENT BY 1
    MINVALUE 0
    MAXVALUE 1
    CACHE 1;

-- TABLE outbox_relay_partitions

CREATE TABLE public.outbox_relay_partitions (
    slot integer NOT NULL,
    owner text,
    token uuid,
    lease_until timestamp with time zone DEFAULT '-infinity'::timestamp with time zone NOT NULL,
    owner_pid integer,
    CONSTRAINT outbox_relay_partitions_slot_check CHECK ((slot >= 0))
);

-- SEQUENCE outbox_relay_requeues

CREATE SEQUENCE public.outbox_relay_requeues
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

-- TABLE outbox_republished

CREATE TABLE public.outbox_republished (
    event_id uuid NOT NULL,
    republished_at timestamp with time zone DEFAULT now() NOT NULL,
    republished_by text NOT NULL,
    reason text NOT NULL,
    previous_stream_id text,
    previous_published_at timestamp with time zone,
    CONSTRAINT outbox_republished_reason_check CHECK (((length(reason) >= 1) AND (length(reason) <= 1000))),
    CONSTRAINT outbox_republished_republished_by_check CHECK (((length(republished_by) >= 1) AND (length(republished_by) <= 200)))
);

-- TABLE outbox_schema_migrations

CREATE TABLE public.outbox_schema_migrations (
    version integer NOT NULL,
    name text NOT NULL,
    applied_at timestamp with time zone DEFAULT now() NOT NULL
);

-- TABLE transfers

CREATE TABLE public.transfers (
    id uuid NOT NULL,
    from_account text NOT NULL,
    to_account text NOT NULL,
    amount_cents bigint NOT NULL,
    currency text DEFAULT 'BRL'::text NOT NULL,
    settled_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT transfers_amount_positive CHECK ((amount_cents > 0)),
    CONSTRAINT transfers_currency_iso CHECK ((currency ~ '^[A-Z]{3}$'::text)),
    CONSTRAINT transfers_distinct_accounts CHECK ((from_account <> to_account)),
    CONSTRAINT transfers_from_account_set CHECK (((length(btrim(from_account)) >= 1) AND (length(btrim(from_account)) <= 64))),
    CONSTRAINT transfers_to_account_set CHECK (((length(btrim(to_account)) >= 1) AND (length(btrim(to_account)) <= 64)))
);

-- DEFAULT outbox_messages seq

ALTER TABLE ONLY public.outbox_messages ALTER COLUMN seq SET DEFAULT nextval('public.outbox_messages_seq'::regclass);

-- CONSTRAINT outbox_cleanups outbox_cleanups_pkey

ALTER TABLE ONLY public.outbox_cleanups
    ADD CONSTRAINT outbox_cleanups_pkey PRIMARY KEY (id);

-- CHECK CONSTRAINT outbox_messages outbox_messages_partition_key_set

ALTER TABLE public.outbox_messages
    ADD CONSTRAINT outbox_messages_partition_key_set CHECK (((partition_key IS NULL) OR ((length(partition_key) >= 1) AND (length(partition_key) <= 200)))) NOT VALID;

-- CHECK CONSTRAINT outbox_messages outbox_messages_payload_size

ALTER TABLE public.outbox_messages
    ADD CONSTRAINT outbox_messages_payload_size CHECK (((payload_bytes IS NULL) OR (payload_bytes <= 16777216))) NOT VALID;

-- CONSTRAINT outbox_messages outbox_messages_pkey

ALTER TABLE ONLY public.outbox_messages
    ADD CONSTRAINT outbox_messages_pkey PRIMARY KEY (id);

-- CONSTRAINT outbox_messages outbox_messages_seq_unique

ALTER TABLE ONLY public.outbox_messages
    ADD CONSTRAINT outbox_messages_seq_unique UNIQUE (seq);

-- CONSTRAINT outbox_operator_actions outbox_operator_actions_pkey

ALTER TABLE ONLY public.outbox_operator_actions
    ADD CONSTRAINT outbox_operator_actions_pkey PRIMARY KEY (id);

-- CONSTRAINT outbox_relay_members outbox_relay_members_pkey

ALTER TABLE ONLY public.outbox_relay_members
    ADD CONSTRAINT outbox_relay_members_pkey PRIMARY KEY (owner);

-- CONSTRAINT outbox_relay_partitions outbox_relay_partitions_pkey

ALTER TABLE ONLY public.outbox_relay_partitions
    ADD CONSTRAINT outbox_relay_partitions_pkey PRIMARY KEY (slot);

-- CONSTRAINT outbox_schema_migrations outbox_schema_migrations_pkey

ALTER TABLE ONLY public.outbox_schema_migrations
    ADD CONSTRAINT outbox_schema_migrations_pkey PRIMARY KEY (version);

-- CONSTRAINT transfers transfers_pkey

ALTER TABLE ONLY public.transfers
    ADD CONSTRAINT transfers_pkey PRIMARY KEY (id);

-- INDEX outbox_messages_dead

CREATE INDEX outbox_messages_dead ON public.outbox_messages USING btree (seq) WHERE dead;

-- INDEX outbox_messages_retrying

CREATE INDEX outbox_messages_retrying ON public.outbox_messages USING btree (aggregate_type, COALESCE(partition_key, aggregate_id), seq) WHERE ((attempts > 0) AND (published_at IS NULL) AND (NOT dead));

-- INDEX outbox_messages_sent_unmarked

CREATE INDEX outbox_messages_sent_unmarked ON public.outbox_messages USING btree (first_sent_at) WHERE (unpublished AND (first_sent_at IS NOT NULL));

-- INDEX outbox_messages_unpublished

CREATE INDEX outbox_messages_unpublished ON public.outbox_messages USING btree (seq) WHERE unpublished;

-- INDEX outbox_messages_unpublished_by_partition

CREATE INDEX outbox_messages_unpublished_by_partition ON public.outbox_messages USING btree (aggregate_type, COALESCE(partition_key, aggregate_id), seq) WHERE ((published_at IS NULL) AND (NOT dead));

-- INDEX outbox_republished_event

CREATE INDEX outbox_republished_event ON public.outbox_republished USING btree (event_id);

-- INDEX transfers_from_account_settled_at

CREATE INDEX transfers_from_account_settled_at ON public.transfers USING btree (from_account, settled_at);

-- TRIGGER outbox_messages outbox_messages_key_settled

CREATE TRIGGER outbox_messages_key_settled BEFORE INSERT ON public.outbox_messages FOR EACH ROW WHEN (((new.partition_key IS NULL) AND (new.event_type = 'transfer.settled'::text))) EXECUTE FUNCTION public.outbox_messages_key_settled();

-- TRIGGER outbox_messages outbox_messages_notify

CREATE TRIGGER outbox_messages_notify BEFORE INSERT ON public.outbox_messages FOR EACH STATEMENT EXECUTE FUNCTION public.outbox_messages_notify_idle();

-- TRIGGER outbox_messages outbox_messages_payload_bytes

CREATE TRIGGER outbox_messages_payload_bytes BEFORE INSERT ON public.outbox_messages FOR EACH ROW WHEN ((pg_column_size(new.payload) > 8192)) EXECUTE FUNCTION public.outbox_messages_payload_bytes();

-- TRIGGER outbox_messages outbox_messages_requeued

CREATE TRIGGER outbox_messages_requeued AFTER UPDATE ON public.outbox_messages FOR EACH ROW WHEN (((NOT old.unpublished) AND new.unpublished)) EXECUTE FUNCTION public.outbox_messages_requeued();
