-- Delete up to @batch inbox rows of @consumer_group recorded before @before
-- (the retention): the oldest first, in short transactions. Returns how many
-- it deleted.
WITH old AS (
    SELECT event_id
      FROM consumer_inbox
     WHERE consumer_group = @consumer_group
       AND processed_at < @before
     ORDER BY processed_at
     LIMIT @batch
)
DELETE FROM consumer_inbox i
 USING old
 WHERE i.consumer_group = @consumer_group
   AND i.event_id = old.event_id
