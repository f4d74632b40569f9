-- Record failed publishes (@errors: the errors, @backoffs_ms: the backoffs) of rows @ids read
-- under the leases of slots @slots with tokens @tokens, where the slot still carries
-- that token: one more attempt, the error kept, and either a retry after the
-- backoff (the row then holds back the later rows of its partition key:
-- relay_read) or, once the attempts reach @max_attempts, the dead-letter status.
-- Returns the rows it updated, with those that went dead.
UPDATE outbox_messages o
   SET attempts = o.attempts + 1,
       last_error = x.error,
       status = CASE WHEN o.attempts + 1 >= @max_attempts THEN 'dead' ELSE 'pending' END,
       next_attempt_at = now() + x.backoff_ms * interval '1 millisecond'
  FROM unnest(@ids::uuid[], @errors::text[], @backoffs_ms::bigint[], @slots::int[], @tokens::uuid[]) AS x(id, error, backoff_ms, slot, token)
  JOIN outbox_relay_partitions s ON s.slot = x.slot AND s.token = x.token
 WHERE o.id = x.id
   AND o.status = 'pending'
RETURNING o.id, o.attempts, o.event_type, o.aggregate_type, o.aggregate_id, o.last_error, o.status = 'dead' AS dead
