-- Give back rows this claim still owns without counting an attempt: the broker
-- was unavailable or the relay is shutting down. They become claimable again
-- after @after_ms milliseconds.
UPDATE outbox_messages
   SET status = 'pending',
       claim_token = NULL,
       last_error = @reason,
       next_attempt_at = now() + @after_ms * interval '1 millisecond'
 WHERE id = ANY(@ids::uuid[])
   AND claim_token = @token
   AND status = 'publishing'
