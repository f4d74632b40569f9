-- Outbox state for metrics, cheap on any table size: the unpublished rows come
-- from the partial index outbox_messages_unpublished, dead rows from
-- outbox_messages_dead. retrying: unpublished rows that failed at least once
-- and wait for their retry (attempts > 0), the rows with repeated failures,
-- from outbox_messages_retrying (its predicate, migration 0022).
-- oldest_transaction_seconds: the age of the oldest transaction of the
-- database's client sessions that holds back the xmin horizon (a snapshot,
-- or a transaction id), this scrape's own aside: while it is open every
-- dead index entry of the outbox stays, and reading a backlog slows down.
-- Sessions of other roles count only where this role may see them
-- (pg_read_all_stats, or pg_monitor).
SELECT (SELECT count(*) FROM outbox_messages WHERE unpublished AND status = 'pending')    AS pending,
       (SELECT count(*) FROM outbox_messages WHERE unpublished AND status = 'publishing') AS publishing,
       (SELECT count(*) FROM outbox_messages WHERE dead)                                  AS dead,
       coalesce((SELECT extract(epoch FROM now() - min(created_at))
                   FROM outbox_messages WHERE unpublished AND status = 'pending'), 0)::float8 AS oldest_pending_seconds,
       (SELECT count(*) FROM outbox_messages WHERE attempts > 0 AND published_at IS NULL AND NOT dead) AS retrying,
       coalesce((SELECT extract(epoch FROM now() - min(xact_start))
                   FROM pg_stat_activity
                  WHERE datname = current_database()
                    AND backend_type = 'client backend'
                    AND pid <> pg_backend_pid()
                    AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)), 0)::float8 AS oldest_transaction_seconds
