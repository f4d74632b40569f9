WITH blocked AS MATERIALIZED (
    SELECT DISTINCT coalesce(partition_key, aggregate_id) AS k FROM outbox_messages
     WHERE unpublished AND attempts > 0),
cand AS MATERIALIZED (
    SELECT o.ctid AS tid, coalesce(o.partition_key, o.aggregate_id) AS k, o.seq FROM outbox_messages o
     WHERE o.unpublished AND o.status = 'pending' AND o.next_attempt_at <= now()
       AND coalesce(o.partition_key, o.aggregate_id) NOT IN (SELECT k FROM blocked)
     ORDER BY o.seq LIMIT 500 FOR UPDATE OF o SKIP LOCKED),
picked AS (SELECT tid FROM (SELECT tid, row_number() OVER (PARTITION BY k ORDER BY seq) AS rn FROM cand) x WHERE rn = 1)
UPDATE outbox_messages o SET status = 'publishing', claimed_at = now(), claimed_by = 'exp', claim_token = gen_random_uuid()
  FROM picked WHERE o.ctid = picked.tid
RETURNING o.id, o.seq, o.aggregate_type, o.aggregate_id, o.event_type, o.payload, o.headers, o.attempts, o.created_at, coalesce(o.partition_key, o.aggregate_id) AS partition_key
