-- Requeue the dead events among the ids @ids: back to pending with the attempts
-- reset, claimable now, the error and the last claim cleared. A row in any
-- other status is left alone. Returns one row per id of @ids, in order: whether
-- it was requeued, and otherwise its status (NULL: no such event). The final
-- SELECT sees the table as it was before the UPDATE.
WITH requeued AS (
    UPDATE outbox_messages
       SET status = 'pending',
           attempts = 0,
           next_attempt_at = now(),
           last_error = NULL,
           claimed_at = NULL,
           claimed_by = NULL,
           claim_token = NULL,
           first_sent_at = NULL
     WHERE id = ANY(@ids::uuid[])
       AND status = 'dead'
    RETURNING id
)
SELECT x.id, r.id IS NOT NULL AS requeued, o.status
  FROM unnest(@ids::uuid[]) WITH ORDINALITY AS x(id, n)
  LEFT JOIN requeued r ON r.id = x.id
  LEFT JOIN outbox_messages o ON o.id = x.id
 ORDER BY x.n
