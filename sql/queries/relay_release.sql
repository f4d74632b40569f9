-- Give back rows this claim still owns without counting an attempt: the broker
-- was unavailable or the relay is shutting down. They become claimable again
-- after $3 milliseconds.
UPDATE outbox_messages
   SET status = 'pending',
       claim_token = NULL,
       last_error = $4,
       next_attempt_at = now() + $3 * interval '1 millisecond'
 WHERE id = ANY($1::uuid[])
   AND claim_token = $2
   AND status = 'publishing'
