WITH picked AS MATERIALIZED (
    SELECT o.ctid AS tid FROM outbox_messages o
     WHERE o.unpublished AND o.status = 'pending' AND o.next_attempt_at <= now()
     ORDER BY o.seq LIMIT 500 FOR UPDATE OF o SKIP LOCKED)
UPDATE outbox_messages o SET status = 'publishing', claimed_at = now(), claimed_by = 'exp', claim_token = gen_random_uuid()
  FROM picked WHERE o.ctid = picked.tid
RETURNING o.id, o.seq, o.aggregate_type, o.aggregate_id, o.event_type, o.payload, o.headers, o.attempts, o.created_at, coalesce(o.partition_key, o.aggregate_id) AS partition_key
