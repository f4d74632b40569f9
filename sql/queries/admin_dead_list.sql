-- Dead events of the aggregate type @aggregate_type (of every type when it is
-- ''), oldest first, at most @max_rows of them, each with the number of such
-- dead rows in all (the window count is taken before LIMIT).
SELECT id, aggregate_type, aggregate_id, event_type, attempts,
       coalesce(last_error, '') AS last_error, created_at,
       count(*) OVER () AS total
  FROM outbox_messages
 WHERE dead
   AND (@aggregate_type::text = '' OR aggregate_type = @aggregate_type)
 ORDER BY seq
 LIMIT @max_rows::bigint
