-- Mark dead, at most @batch at a time, the events that may have reached the
-- broker longer than the redelivery window @window_ms ago and were never
-- marked published (migration 0011): publishing one again could apply it
-- twice, its consumers' dedupe records being gone. The error says so; an
-- operator who knows the records still hold can retry it (outbox dead retry).
-- Dead, it no longer holds back the later events of its key. The partial
-- index outbox_messages_sent_unmarked (migration 0011) holds only such rows.
WITH expired AS MATERIALIZED (
    SELECT id
      FROM outbox_messages
     WHERE unpublished
       AND first_sent_at IS NOT NULL
       AND first_sent_at < now() - @window_ms::bigint * interval '1 millisecond'
       AND status = 'pending'
     ORDER BY first_sent_at
     LIMIT @batch::bigint
       FOR UPDATE SKIP LOCKED
)
UPDATE outbox_messages o
   SET status = 'dead',
       last_error = 'redelivery window passed: the event may have reached the broker at ' || o.first_sent_at ||
                    ' and was never marked published; publishing it again could apply it twice (the consumers'' dedupe records '
                    || 'may be gone): retry it (outbox dead retry) only if they still hold it'
  FROM expired
 WHERE o.id = expired.id
RETURNING o.id
