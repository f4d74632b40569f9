-- Read up to @batch publishable rows of the slots @usable_slots (of @slots slots) that this
-- relay leases (relay.Config.Ownership "partitions"; migration 0010), other
-- than the rows @in_flight (published, their mark still in flight). No
-- lock and no UPDATE: the lease makes these rows this relay's alone, and the
-- mark is fenced by the lease's token instead (relay_mark_published_leased).
--
-- ORDER BY seq: a slot's rows are published in commit order per partition
-- key (writers of one key commit in seq order: outbox_lock_partitions).
-- NOT EXISTS: a row waits while an older row of its partition key waits for
-- a retry (attempts > 0, still unpublished); the partial index
-- outbox_messages_retrying holds only such rows, so the check reads next to
-- nothing. Rows below the floor's keys_from are published or dead (the
-- second NOT EXISTS says what lies between).
-- The relay keeps the first row of each partition key and leaves the rest to
-- its next read, so that a failed publish can never be overtaken by a later
-- event of the same key published in the same pipeline.
-- outbox_relay_read_from: the relay's floor, as in relay_claim.sql. The second
-- NOT EXISTS reads its hole (rows of writers the floor passed over while they
-- were open, migration 0019): empty unless there is one. It reads the hole's
-- bounds as outbox_relay_floor set them, not through the floor's functions:
-- a requeue's nextval makes those answer 0 from the moment it lands, and one
-- that landed after the scan had started at the floor made the check take
-- the hole for empty (TestReadLeavesOutAKeysEventBehindOneInTheHoleWhen-
-- ARequeueLandsMidRead). Read so, the check is right whichever floor the
-- scan started at: it only ever holds a row back behind an older unpublished
-- row of its key (p.seq < o.seq: a row of the hole read from 0 is not held
-- back by itself).
-- Both checks name the predicate of their index (published_at IS NULL AND
-- NOT dead, not unpublished: migration 0022), so that no read in seq order
-- can answer them, and both are probes of the row's key (OFFSET 0, as in
-- relay_claim.sql: as an anti-join, the first scanned the whole retrying
-- index for each row read, 158 ms a read with 2,100 rows retrying). Each
-- runs only while it can find something, which one InitPlan tells for the
-- whole read: the first while any row waits for a retry, the second while
-- there is a hole (keys_from below read_from). A probe per row read cost
-- the drain a sixth of its rate (outbox bench drain, docs/log.md).
-- next_attempt_at: against clock_timestamp(), as in relay_claim.sql.
-- first_sent_at: as in relay_claim.sql, the redelivery window @window_ms.
-- @max_bytes: of the first row of each partition key (the relay publishes
-- no more per read), the smallest first while the payload bytes before each
-- stay under it, and the oldest of them whatever its size, as in
-- relay_claim.sql. The payloads
-- pass through the window functions as stored (TOAST pointers) and are read
-- for the rows returned only.
SELECT id, seq, aggregate_type, aggregate_id, event_type, payload, headers, attempts, created_at, partition_key
  FROM (SELECT c.*, sum(c.bytes) OVER (ORDER BY c.bytes, c.seq) - c.bytes AS before, min(c.seq) OVER () AS oldest
          FROM (SELECT r.*,
                       row_number() OVER (PARTITION BY r.aggregate_type, r.partition_key ORDER BY r.seq) AS nth
                  FROM (SELECT o.id, o.seq, o.aggregate_type, o.aggregate_id, o.event_type,
                               o.payload, o.headers, o.attempts, o.created_at,
                               coalesce(o.partition_key, o.aggregate_id) AS partition_key,
                               coalesce(o.payload_bytes, pg_column_size(o.payload)) AS bytes
                          FROM outbox_messages o
                         WHERE o.unpublished
                           AND o.seq >= outbox_relay_read_from()
                           AND o.status = 'pending'
                           AND o.next_attempt_at <= clock_timestamp()
                           AND (o.first_sent_at IS NULL OR o.first_sent_at > now() - @window_ms::bigint * interval '1 millisecond')
                           AND outbox_relay_slot(coalesce(o.partition_key, o.aggregate_id), @slots) = ANY(@usable_slots::int[])
                           AND o.seq NOT IN (SELECT unnest(@in_flight::bigint[]))
                           AND NOT EXISTS (
                               SELECT 1
                                 FROM outbox_messages p
                                WHERE (SELECT EXISTS (SELECT 1 FROM outbox_messages w
                                                       WHERE w.attempts > 0
                                                         AND w.published_at IS NULL AND NOT w.dead))
                                  AND p.attempts > 0
                                  AND p.published_at IS NULL AND NOT p.dead
                                  AND p.aggregate_type = o.aggregate_type
                                  AND coalesce(p.partition_key, p.aggregate_id) = coalesce(o.partition_key, o.aggregate_id)
                                  AND p.seq >= outbox_relay_keys_from()
                                  AND p.seq < o.seq
                               OFFSET 0)
                           AND NOT EXISTS (
                               SELECT 1
                                 FROM outbox_messages p
                                WHERE (SELECT coalesce(nullif(current_setting('outbox.keys_from', true), '')::bigint, 0))
                                      < (SELECT coalesce(nullif(current_setting('outbox.read_from', true), '')::bigint, 0))
                                  AND p.published_at IS NULL AND NOT p.dead
                                  AND p.aggregate_type = o.aggregate_type
                                  AND coalesce(p.partition_key, p.aggregate_id) = coalesce(o.partition_key, o.aggregate_id)
                                  AND p.seq >= coalesce(nullif(current_setting('outbox.keys_from', true), '')::bigint, 0)
                                  AND p.seq < coalesce(nullif(current_setting('outbox.read_from', true), '')::bigint, 0)
                                  AND p.seq < o.seq
                               OFFSET 0)
                         ORDER BY o.seq
                         LIMIT @batch) r) c
         WHERE c.nth = 1) f
 WHERE f.before < @max_bytes::bigint
    OR f.seq = f.oldest
 ORDER BY f.seq
