-- Rows per status and the age of the oldest pending row, in seconds, for
-- 'outbox status' (and the chaos suite's progress), of the aggregate type
-- @aggregate_type, or of every type when it is ''. retrying: unpublished
-- rows that failed at least once (attempts > 0), as in metrics_outbox.sql.
-- It counts published rows too, so it reads the whole table: the metrics
-- scrape uses metrics_outbox.sql, which reads only the partial indexes.
SELECT count(*) FILTER (WHERE status = 'pending')    AS pending,
       count(*) FILTER (WHERE status = 'publishing') AS publishing,
       count(*) FILTER (WHERE status = 'published')  AS published,
       count(*) FILTER (WHERE status = 'dead')       AS dead,
       coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending')), 0)::float8
                                                     AS oldest_pending_seconds,
       count(*) FILTER (WHERE unpublished AND attempts > 0) AS retrying
  FROM outbox_messages
 WHERE @aggregate_type::text = '' OR aggregate_type = @aggregate_type
