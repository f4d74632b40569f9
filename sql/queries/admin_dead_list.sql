-- Dead events, oldest first, at most @max_rows of them, each with the number of dead
-- rows in all (the window count is taken before LIMIT).
SELECT id, aggregate_type, aggregate_id, event_type, attempts,
       coalesce(last_error, '') AS last_error, created_at,
       count(*) OVER () AS total
  FROM outbox_messages
 WHERE dead
 ORDER BY seq
 LIMIT @max_rows::bigint
