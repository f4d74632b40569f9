-- Mark published the rows this claim still owns. A row that was reaped and
-- re-claimed carries another token and is left alone (the stale relay is fenced).
UPDATE outbox_messages o
   SET status = 'published',
       published_at = now(),
       stream_id = x.stream_id,
       claim_token = NULL,
       last_error = NULL
  FROM unnest(@ids::uuid[], @stream_ids::text[]) AS x(id, stream_id)
 WHERE o.id = x.id
   AND o.claim_token = @token
   AND o.status = 'publishing'
