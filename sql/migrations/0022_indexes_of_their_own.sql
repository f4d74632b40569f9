-- Each partial index of unpublished rows gets a predicate of its own, and
-- each relay query names the predicate of the index it must use, so that
-- no other index can answer it, whatever the statistics say.
--
-- The three indexes all had the predicate unpublished (or implied by it).
-- Any of them could then serve a query on unpublished rows, and the planner
-- chose by the statistics. Once ANALYZE had seen an outbox whose rows were
-- nearly all published (the usual state: autovacuum analyzes an idle
-- outbox), the statistics put almost nothing in these indexes, every scan
-- of them looked free, and the planner read the floor's range (seq >=
-- floor) through the per-key index, or a key's checks through the seq index
-- or a full scan. Behind a long transaction an index still holds an entry
-- for every row published since the transaction began, and each of those
-- scans walked them all, for every row read: the read floor (migration
-- 0019) skipped nothing (TestReadsSkipWhatALongTransactionKeeps, with an
-- ANALYZE where autovacuum would run one).
--
--   outbox_messages_unpublished (seq), WHERE unpublished: reads in seq
--     order from the floor (relay_claim.sql, relay_read.sql,
--     outbox_relay_floor, the reaper). Unchanged.
--   outbox_messages_unpublished_by_partition, WHERE published_at IS NULL
--     AND NOT dead: a key's unpublished rows (the key checks of
--     relay_claim.sql and relay_read.sql).
--   outbox_messages_retrying, WHERE attempts > 0 AND published_at IS NULL
--     AND NOT dead: a key's rows waiting for their retry (relay_read.sql).
--
-- The same rows as before: published_at is set exactly when the status is
-- published (outbox_messages_published_consistent), so published_at IS
-- NULL AND NOT dead holds exactly when unpublished does; the planner just
-- cannot prove one from the other. None of these columns is written by a
-- claim, a release or a reap (they change status alone, and unpublished
-- stays true), so those updates stay HOT (migration 0007).
--
-- The table is locked for every session (ACCESS EXCLUSIVE) from the start:
-- building the indexes reads the table once, and writers and relays wait
-- meanwhile. Taking a weaker lock first (building the new indexes before
-- dropping the old ones) deadlocks with a relay, whose transactions read
-- the table and then update it: the drop's stronger lock waits for the
-- relay's read, the relay's update for the build's lock. The migration
-- gives up after 5 s (lock_timeout) rather than stall writers and relays
-- behind a long transaction; run it again when that one has ended
-- (CHANGELOG).
--
-- outbox_relay_floor finds the lowest unpublished row from the floor with
-- ORDER BY seq LIMIT 1 instead of min(seq). With the same statistics the
-- planner computed min() by reading every unpublished row from the floor,
-- for each move of the floor: a backlog of 20,000 rows drained with 459,000
-- index entries read instead of 49,040
-- (TestBacklogUnderStatisticsOfAPublishedOutbox).
SET LOCAL lock_timeout = '5s';

LOCK TABLE outbox_messages IN ACCESS EXCLUSIVE MODE;

DROP INDEX outbox_messages_unpublished_by_partition;

CREATE INDEX outbox_messages_unpublished_by_partition
    ON outbox_messages (aggregate_type, (coalesce(partition_key, aggregate_id)), seq)
    WHERE published_at IS NULL AND NOT dead;

DROP INDEX outbox_messages_retrying;

CREATE INDEX outbox_messages_retrying
    ON outbox_messages (aggregate_type, (coalesce(partition_key, aggregate_id)), seq)
    WHERE attempts > 0 AND published_at IS NULL AND NOT dead;

CREATE OR REPLACE FUNCTION outbox_relay_floor(
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
