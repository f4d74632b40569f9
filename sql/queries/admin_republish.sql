-- Republish the events @ids that are published: back to pending with their
-- own seq (the oldest unpublished event of its key again, it goes before the
-- key's later events, as a requeued dead event does), attempts 0, the
-- redelivery window restarted (first_sent_at NULL: the operator says the
-- entries are gone, so consumers' dedupe records for them may be too), and
-- one audit row each in outbox_republished (@by, @reason, the entry it had).
-- Fenced: only rows still published are touched, locked for the statement,
-- so an event republished twice at once is republished once; rows in any
-- other status are reported with their status, unknown ids with none.
-- Returns each requested id once, whether it was republished, and its status
-- before.
WITH target AS MATERIALIZED (
    SELECT o.id, o.stream_id, o.published_at
      FROM outbox_messages o
     WHERE o.id = ANY (@ids::uuid[])
       AND o.status = 'published'
       FOR UPDATE
), moved AS (
    UPDATE outbox_messages o
       SET status = 'pending',
           attempts = 0,
           published_at = NULL,
           stream_id = NULL,
           first_sent_at = NULL,
           next_attempt_at = now(),
           last_error = NULL,
           claim_token = NULL,
           claimed_at = NULL,
           claimed_by = NULL,
           claimed_pid = NULL
      FROM target t
     WHERE o.id = t.id
       AND o.status = 'published'
    RETURNING o.id
), audit AS (
    INSERT INTO outbox_republished (event_id, republished_by, reason, previous_stream_id, previous_published_at)
    SELECT t.id, @by, @reason, t.stream_id, t.published_at
      FROM target t
      JOIN moved m ON m.id = t.id
    RETURNING event_id
)
SELECT r.id, r.id IN (SELECT event_id FROM audit) AS republished, o.status
  FROM (SELECT DISTINCT unnest(@ids::uuid[]) AS id) r
  LEFT JOIN outbox_messages o ON o.id = r.id
 ORDER BY r.id
