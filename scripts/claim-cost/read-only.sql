SELECT o.id, o.seq, o.aggregate_type, o.aggregate_id, o.event_type, o.payload, o.headers, o.attempts, o.created_at, coalesce(o.partition_key, o.aggregate_id) AS partition_key
  FROM outbox_messages o
 WHERE o.unpublished AND o.status = 'pending' AND o.next_attempt_at <= now()
 ORDER BY o.seq LIMIT 500
