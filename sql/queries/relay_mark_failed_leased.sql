-- Record failed publishes ($2: the errors, $3: the backoffs) of rows $1 read
-- under the leases of slots $4 with tokens $5, where the slot still carries
-- that token: one more attempt, the error kept, and either a retry after the
-- backoff (the row then holds back the later rows of its partition key:
-- relay_read) or, once the attempts reach $6, the dead-letter status.
-- Returns the rows it updated, with those that went dead.
UPDATE outbox_messages o
   SET attempts = o.attempts + 1,
       last_error = x.error,
       status = CASE WHEN o.attempts + 1 >= $6 THEN 'dead' ELSE 'pending' END,
       next_attempt_at = now() + x.backoff_ms * interval '1 millisecond'
  FROM unnest($1::uuid[], $2::text[], $3::bigint[], $4::int[], $5::uuid[]) AS x(id, error, backoff_ms, slot, token)
  JOIN outbox_relay_partitions s ON s.slot = x.slot AND s.token = x.token
 WHERE o.id = x.id
   AND o.status = 'pending'
RETURNING o.id, o.attempts, o.event_type, o.aggregate_type, o.aggregate_id, o.last_error, o.status = 'dead' AS dead
