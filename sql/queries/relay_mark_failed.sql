-- Record failed publishes of rows this claim still owns: one more attempt, the
-- error kept, and either a retry after the given backoff or, once the attempts
-- reach @max_attempts, the dead-letter status. Returns the rows that went dead.
UPDATE outbox_messages o
   SET attempts = o.attempts + 1,
       last_error = x.error,
       status = CASE WHEN o.attempts + 1 >= @max_attempts THEN 'dead' ELSE 'pending' END,
       next_attempt_at = now() + x.backoff_ms * interval '1 millisecond',
       claim_token = NULL
  FROM unnest(@ids::uuid[], @errors::text[], @backoffs_ms::bigint[]) AS x(id, error, backoff_ms)
 WHERE o.id = x.id
   AND o.claim_token = @token
   AND o.status = 'publishing'
RETURNING o.id, o.attempts, o.event_type, o.aggregate_type, o.aggregate_id, o.last_error, o.status = 'dead' AS dead
