-- Return claims whose lease (@lease_ms milliseconds, measured on the database clock)
-- expired to pending, and the claims of relays that died (their LISTEN
-- backend, claimed_pid, no longer holds its lock: migration 0012), at most
-- @batch rows. An expired lease counts as a failed
-- attempt, so an event that keeps killing relays ends up dead after @max_attempts.
-- Clearing claim_token fences the relay that held the claim.
-- @self_pid is the reaping relay's own LISTEN backend (0 while it has none):
-- its own claims are a live relay's, whatever pg_locks says by the time this
-- statement reads it. Without it, a relay killed right after a claim could
-- have its own reaper statement, already on its way, return that claim as a
-- dead relay's once the server ended the relay's LISTEN backend (harmless,
-- but the claim looked abandoned by nobody).
-- outbox_relay_read_from: the reaper's floor (migration 0019; relay/floor.go),
-- 0 when its transaction did not set one.
WITH expired AS MATERIALIZED (
    SELECT id
      FROM outbox_messages
     WHERE unpublished
       AND seq >= outbox_relay_read_from()
       AND status = 'publishing'
       AND (claimed_at < now() - @lease_ms * interval '1 millisecond'
            OR (claimed_pid IS NOT NULL
                AND claimed_pid <> @self_pid
                AND claimed_pid NOT IN (SELECT pid FROM outbox_live_relays)))
     ORDER BY seq
     LIMIT @batch
       FOR UPDATE SKIP LOCKED
)
UPDATE outbox_messages o
   SET status = CASE WHEN o.attempts + 1 >= @max_attempts THEN 'dead' ELSE 'pending' END,
       attempts = o.attempts + 1,
       last_error = CASE WHEN o.claimed_at < now() - @lease_ms * interval '1 millisecond'
                         THEN 'lease expired (claimed by ' || coalesce(o.claimed_by, 'unknown') || ')'
                         ELSE 'relay died (claimed by ' || coalesce(o.claimed_by, 'unknown') || ')' END,
       claim_token = NULL,
       claimed_pid = NULL,
       -- the claim may have been published before its relay died
       first_sent_at = coalesce(o.first_sent_at, o.claimed_at),
       next_attempt_at = now()
  FROM expired
 WHERE o.id = expired.id
RETURNING o.id
