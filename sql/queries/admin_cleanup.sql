-- Delete one batch of published rows published before @before: at most @batch of them,
-- in seq order after seq @after_seq (the last seq of the previous batch, so each batch
-- starts where the previous one stopped instead of rescanning the rows it
-- deleted, which stay in the index until vacuum). Run in its own short
-- transaction. Returns how many rows it deleted and the last seq it deleted.
--
-- Only published rows are touched: pending, publishing and dead rows are never
-- deleted, and relays never write published rows, so this is safe while they
-- run. SKIP LOCKED: a row someone holds is skipped rather than waited for.
-- MATERIALIZED: the locking subquery runs once, so LIMIT holds.
WITH doomed AS MATERIALIZED (
    SELECT id
      FROM outbox_messages
     WHERE status = 'published'
       AND published_at < @before::timestamptz
       AND seq > @after_seq::bigint
     ORDER BY seq
     LIMIT @batch::bigint
       FOR UPDATE SKIP LOCKED
), deleted AS (
    DELETE FROM outbox_messages
     WHERE id IN (SELECT id FROM doomed)
       AND status = 'published'
    RETURNING seq
)
SELECT count(*), coalesce(max(seq), @after_seq::bigint) FROM deleted
