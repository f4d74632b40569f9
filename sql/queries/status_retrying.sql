-- The rows waiting for a retry after a failed publish (attempts > 0, still
-- unpublished, stated as the predicate of outbox_messages_retrying), of the aggregate
-- type @aggregate_type or of every type when it is '', the next due first, at
-- most @max_rows of them, each with the number of such rows in all (the
-- window count is taken before LIMIT). next_attempt_in: seconds until the
-- relay may try it again (0 or less: now; a row being published now shows
-- its status 'publishing').
SELECT id, aggregate_type, aggregate_id, event_type, status, attempts,
       coalesce(last_error, '') AS last_error,
       extract(epoch FROM next_attempt_at - now())::float8 AS next_attempt_in,
       count(*) OVER () AS total
  FROM outbox_messages
 WHERE attempts > 0 AND published_at IS NULL AND NOT dead
   AND (@aggregate_type::text = '' OR aggregate_type = @aggregate_type)
 ORDER BY next_attempt_at, seq
 LIMIT @max_rows::bigint
