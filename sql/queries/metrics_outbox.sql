-- Outbox state for metrics, cheap on any table size: the unpublished rows come
-- from the partial index outbox_messages_unpublished, dead rows from
-- outbox_messages_dead. retrying: unpublished rows that failed at least once
-- and wait for their retry (attempts > 0), the rows with repeated failures.
SELECT (SELECT count(*) FROM outbox_messages WHERE unpublished AND status = 'pending')    AS pending,
       (SELECT count(*) FROM outbox_messages WHERE unpublished AND status = 'publishing') AS publishing,
       (SELECT count(*) FROM outbox_messages WHERE dead)                                  AS dead,
       coalesce((SELECT extract(epoch FROM now() - min(created_at))
                   FROM outbox_messages WHERE unpublished AND status = 'pending'), 0)::float8 AS oldest_pending_seconds,
       (SELECT count(*) FROM outbox_messages WHERE unpublished AND attempts > 0)         AS retrying
