-- Return claims whose lease ($1 milliseconds, measured on the database clock)
-- expired to pending, at most $2 rows. An expired lease counts as a failed
-- attempt, so an event that keeps killing relays ends up dead after $3.
-- Clearing claim_token fences the relay that held the claim.
WITH expired AS MATERIALIZED (
    SELECT id
      FROM outbox_messages
     WHERE unpublished
       AND status = 'publishing'
       AND claimed_at < now() - $1 * interval '1 millisecond'
     ORDER BY seq
     LIMIT $2
       FOR UPDATE SKIP LOCKED
)
UPDATE outbox_messages o
   SET status = CASE WHEN o.attempts + 1 >= $3 THEN 'dead' ELSE 'pending' END,
       attempts = o.attempts + 1,
       last_error = 'lease expired (claimed by ' || coalesce(o.claimed_by, 'unknown') || ')',
       claim_token = NULL,
       next_attempt_at = now()
  FROM expired
 WHERE o.id = expired.id
RETURNING o.id
