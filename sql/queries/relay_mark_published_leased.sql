-- Mark published the rows @ids (stream entries @stream_ids) read under the leases of
-- slots @slots with tokens @tokens, one slot and token per row, where the slot still
-- carries that token. A relay that took the slot over carries another token:
-- the stale relay's rows are left to it (the duplicates it published are
-- skipped by consumers).
UPDATE outbox_messages o
   SET status = 'published',
       published_at = now(),
       stream_id = x.stream_id,
       last_error = NULL
  FROM unnest(@ids::uuid[], @stream_ids::text[], @slots::int[], @tokens::uuid[]) AS x(id, stream_id, slot, token)
  JOIN outbox_relay_partitions s ON s.slot = x.slot AND s.token = x.token
 WHERE o.id = x.id
   AND o.status = 'pending'
