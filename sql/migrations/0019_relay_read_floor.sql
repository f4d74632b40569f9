-- The relays read from a floor, not from the oldest index entry.
--
-- While a transaction holds the xmin horizon (a long report, a migration, a
-- session idle in transaction), PostgreSQL keeps every row version that a
-- mark leaves behind, and their entries in outbox_messages_unpublished stay
-- too: they cannot be marked dead while that transaction might still see
-- them. Every read of "the oldest unpublished rows" then walked them all
-- again, one heap visit each: a backlog of 1,000,000 drained 5.9 times
-- slower, slowing as it went, and a fresh event waited for that walk.
--
-- So a relay's reads start at a floor: a seq below which every row is
-- published or dead, and stays so. outbox_relay_floor() moves it up, in the
-- relay's claim transaction, and the reads ask outbox_relay_read_from() for
-- it. What keeps a row below the floor from becoming publishable:
--
--   1. a row committed late, with a seq taken before the floor rose. A
--      writer takes the table's RowExclusiveLock before it draws a seq (the
--      INSERT locks its table before its defaults and triggers run) and
--      keeps it to its end, and the sequence hands out values in order
--      (CACHE 1). So the floor takes a candidate: the sequence's last value
--      and the transactions then holding that lock (pg_locks, which every
--      role may read); once none of them holds it any more, every row up to
--      that value is committed or rolled back, and the floor may rise to
--      the lowest unpublished seq, that value + 1 at most.
--   2. a writer that stays open (a batch import, a session idle in a
--      transaction that wrote an event): the relay does not wait for it
--      longer than its grace (relay/floor.go). Its rows can only lie above
--      the floor it found, which is kept as the hole; the keys' order
--      checks read from the hole, and the floor goes back down to it when
--      those writers end, when their rows become visible.
--   3. a row made unpublished again (outbox dead retry, outbox republish,
--      or any UPDATE): a trigger counts it in outbox_relay_requeues, and a
--      read that sees the count move reads from 0, as does the next floor.
--      The count is read by the read itself, after its snapshot: a requeue
--      committed before that snapshot has moved it.
--
-- Claims, marks and releases move rows between pending and publishing,
-- both unpublished: they never cross the floor. A row inserted with a seq
-- chosen by hand (only the table's owner may) below the floor waits for
-- the relay's next full read (relay/floor.go); bump outbox_relay_requeues
-- after such an insert.

CREATE SEQUENCE outbox_relay_requeues;

CREATE FUNCTION outbox_messages_requeued() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM nextval('outbox_relay_requeues');
    RETURN NULL;
END
$$;

CREATE TRIGGER outbox_messages_requeued AFTER UPDATE ON outbox_messages
    FOR EACH ROW WHEN (NOT OLD.unpublished AND NEW.unpublished)
    EXECUTE FUNCTION outbox_messages_requeued();

-- outbox_relay_writers: the transactions (pg_locks.virtualtransaction),
-- other than the caller's, that hold a lock on outbox_messages taken to
-- write it. PL/pgSQL, whose plan is kept for the session: as a SQL
-- function it was planned at every call (0.15 ms a transaction).
CREATE FUNCTION outbox_relay_writers() RETURNS text[]
LANGUAGE plpgsql VOLATILE AS $$
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

-- outbox_relay_floor moves a relay's floor. Its state travels with the
-- relay (relay/floor.go) and comes back updated:
--   floor_seq     rows below it are published or dead
--   mark, writers the candidate: the sequence's last value and the writers
--                 then open (NULL: none taken yet); taken says this call
--                 took a new one
--   hole, hole_writers
--                 the floor found when writers were passed over (force),
--                 and those writers
--   requeues      outbox_relay_requeues as last seen
-- force passes the candidate over its writers that are still open (they
-- have outlived the relay's grace). It sets outbox.read_from and
-- outbox.keys_from for the reads of the same transaction.
CREATE FUNCTION outbox_relay_floor(
    INOUT floor_seq bigint, INOUT mark bigint, INOUT writers text[],
    INOUT hole bigint, INOUT hole_writers text[], INOUT requeues bigint,
    force boolean, OUT taken boolean)
LANGUAGE plpgsql VOLATILE AS $$
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
            SELECT min(o.seq) INTO lowest
              FROM outbox_messages o
             WHERE o.unpublished
               AND o.seq >= floor_seq;
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

-- outbox_relay_read_from is where the reads of rows to publish start, and
-- outbox_relay_keys_from where their checks of a key's older rows start:
-- 0 (everything) unless outbox_relay_floor ran in this transaction and no
-- row was requeued since (outbox_relay_setting_from, given the setting).
-- STABLE, so that a read's index scan starts there; it is evaluated after
-- the read's snapshot was taken.
CREATE FUNCTION outbox_relay_setting_from(setting text) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN coalesce(pg_sequence_last_value('outbox_relay_requeues'), 0)::text
                     = current_setting('outbox.requeues', true)
                THEN coalesce(nullif(current_setting(setting, true), '')::bigint, 0)
                ELSE 0 END
$$;

CREATE FUNCTION outbox_relay_read_from() RETURNS bigint
LANGUAGE sql STABLE AS $$ SELECT outbox_relay_setting_from('outbox.read_from') $$;

CREATE FUNCTION outbox_relay_keys_from() RETURNS bigint
LANGUAGE sql STABLE AS $$ SELECT outbox_relay_setting_from('outbox.keys_from') $$;
