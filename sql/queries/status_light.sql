-- The outbox's rows for a caller that reads often (the console, every two
-- seconds), of the aggregate type @aggregate_type or of every type when it
-- is '': what status.sql counts but the published rows, read through the
-- partial indexes (outbox_messages_unpublished, outbox_messages_dead; the
-- retrying rows are counted in the same walk of the unpublished ones), so
-- its cost follows the backlog, not the table. published is NULL: not
-- counted.
SELECT count(*) FILTER (WHERE status = 'pending')    AS pending,
       count(*) FILTER (WHERE status = 'publishing') AS publishing,
       NULL::bigint                                  AS published,
       (SELECT count(*) FROM outbox_messages
         WHERE dead AND (@aggregate_type::text = '' OR aggregate_type = @aggregate_type)) AS dead,
       coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending')), 0)::float8
                                                     AS oldest_pending_seconds,
       count(*) FILTER (WHERE attempts > 0)          AS retrying
  FROM outbox_messages
 WHERE unpublished
   AND (@aggregate_type::text = '' OR aggregate_type = @aggregate_type)
