-- Requeue one batch of dead events: at most @batch of them, in seq order after
-- seq @after_seq (the caller passes the last seq of the previous batch, so a row that
-- dies again while the batches run is not requeued twice). Same reset as
-- admin_dead_retry. Returns how many were requeued and the last seq seen.
-- MATERIALIZED: the locking subquery runs once, so LIMIT holds.
WITH picked AS MATERIALIZED (
    SELECT id
      FROM outbox_messages
     WHERE dead
       AND seq > @after_seq::bigint
     ORDER BY seq
     LIMIT @batch::bigint
       FOR UPDATE SKIP LOCKED
), requeued AS (
    UPDATE outbox_messages o
       SET status = 'pending',
           attempts = 0,
           next_attempt_at = now(),
           last_error = NULL,
           claimed_at = NULL,
           claimed_by = NULL,
           claim_token = NULL,
           first_sent_at = NULL
      FROM picked
     WHERE o.id = picked.id
       AND o.status = 'dead'
    RETURNING o.seq
)
SELECT count(*), coalesce(max(seq), @after_seq::bigint) FROM requeued
