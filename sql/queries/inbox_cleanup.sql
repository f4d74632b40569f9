-- Delete up to @batch inbox rows of @consumer_group recorded more than
-- @retention_us microseconds ago, by the database's clock (processed_at is
-- its now() too: a consumer's clock running ahead must not delete early):
-- the oldest first, in short transactions. Returns how many it deleted.
WITH old AS (
    SELECT event_id
      FROM consumer_inbox
     WHERE consumer_group = @consumer_group
       AND processed_at < now() - @retention_us::bigint * interval '1 microsecond'
     ORDER BY processed_at
     LIMIT @batch
)
DELETE FROM consumer_inbox i
 USING old
 WHERE i.consumer_group = @consumer_group
   AND i.event_id = old.event_id
