-- Claim up to @batch publishable rows for relay @relay with the fresh fencing token @token;
-- @pid is the relay's LISTEN backend (0: its LISTEN connection is down), so
-- that the other relays take the claim over the moment that backend is gone
-- (migration 0012) rather than when the lease runs out.
--
-- MATERIALIZED: the locking subquery runs exactly once, so LIMIT holds under
-- concurrency (a plain IN (subquery) may be rescanned and lock more rows).
-- SKIP LOCKED: concurrent relays take disjoint rows without waiting.
-- NOT EXISTS: an event is claimable only when no older event of the same
-- aggregate type and partition key (NULL: the aggregate id) is still
-- unpublished, which keeps per-partition-key order across relays, failures
-- and backoff (a batch holds at most one event per partition key).
-- unpublished, published_at IS NULL AND NOT dead: the same rows, each the
-- predicate of the index that must answer its part, the read in seq order
-- (outbox_messages_unpublished) and the key's check
-- (outbox_messages_unpublished_by_partition), and no other, whatever the
-- statistics say (migration 0022).
-- OFFSET 0: the check stays a probe of the row's own key, run for each row
-- read (an anti-join may scan the whole index for each).
-- outbox_relay_read_from, outbox_relay_keys_from: the relay's floor (migration
-- 0019), set by outbox_relay_floor earlier in the claim's transaction: rows
-- below it are published or dead, so neither the read nor the key's check
-- walks the index entries that marks left behind (0: from the start).
-- next_attempt_at: against clock_timestamp(), not now() (this transaction's
-- start): a fresh row's is its writer's start, and a writer that began after
-- this transaction (the relay waited for the writers that saw it busy) and
-- committed before this statement is visible to it and must be taken (a
-- partition owner would publish the key's next event first; a relay going
-- to sleep would leave it for the poll).
-- first_sent_at: a row that may have reached the broker longer than the
-- redelivery window @window_ms ago is never published again (migration 0011;
-- the reaper marks it dead).
-- ctid: the picked rows are locked by this statement, so their row versions
-- cannot change under it; a TID scan finds each again without an index probe.
-- @max_bytes: of the picked rows, the claim takes the smallest first while
-- the payload bytes before each stay under it (at least one row, whatever
-- its size), so that a batch is bounded by bytes as well as rows and small
-- events are not held behind big ones (a batch holds one event per key, so
-- its order within the batch does not matter), and the oldest picked row
-- too, whatever its size, so that a steady flow of smaller rows can never
-- keep a big one (and the rest of its key) waiting. The rest stay pending; they
-- were locked only for this statement. A row's size is payload_bytes, set
-- when a big payload is written (migration 0016), else its stored size
-- (a small payload's: at most 8 kB raw).
WITH picked AS MATERIALIZED (
    SELECT o.ctid AS tid, o.seq, coalesce(o.payload_bytes, pg_column_size(o.payload)) AS bytes
      FROM outbox_messages o
     WHERE o.unpublished
       AND o.seq >= outbox_relay_read_from()
       AND o.status = 'pending'
       AND o.next_attempt_at <= clock_timestamp()
       AND (o.first_sent_at IS NULL OR o.first_sent_at > now() - @window_ms::bigint * interval '1 millisecond')
       AND NOT EXISTS (
           SELECT 1
             FROM outbox_messages p
            WHERE p.aggregate_type = o.aggregate_type
              AND coalesce(p.partition_key, p.aggregate_id) = coalesce(o.partition_key, o.aggregate_id)
              AND p.seq < o.seq
              AND p.seq >= outbox_relay_keys_from()
              AND p.published_at IS NULL AND NOT p.dead
           OFFSET 0)
     ORDER BY o.seq
     LIMIT @batch
       FOR UPDATE OF o SKIP LOCKED
), fits AS (
    SELECT s.tid
      FROM (SELECT tid, seq, sum(bytes) OVER (ORDER BY bytes, seq) - bytes AS before FROM picked) s
     WHERE s.before < @max_bytes::bigint
        OR s.seq = (SELECT min(seq) FROM picked)
)
UPDATE outbox_messages o
   SET status = 'publishing',
       claimed_at = now(),
       claimed_by = @relay,
       claim_token = @token,
       claimed_pid = nullif(@pid::int, 0)
  FROM fits
 WHERE o.ctid = fits.tid
RETURNING o.id, o.seq, o.aggregate_type, o.aggregate_id, o.event_type,
          o.payload, o.headers, o.attempts, o.created_at,
          coalesce(o.partition_key, o.aggregate_id) AS partition_key
