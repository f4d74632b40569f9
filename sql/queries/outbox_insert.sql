-- Insert outbox messages given as parallel arrays (one element per message).
-- An empty partition key is stored as NULL: the aggregate id.
INSERT INTO outbox_messages (id, aggregate_type, aggregate_id, event_type, payload, headers, partition_key)
SELECT m.id, m.aggregate_type, m.aggregate_id, m.event_type, m.payload, m.headers, nullif(m.partition_key, '')
  FROM unnest(@ids::uuid[], @aggregate_types::text[], @aggregate_ids::text[], @event_types::text[], @payloads::jsonb[], @headers::jsonb[], @partition_keys::text[])
       WITH ORDINALITY AS m(id, aggregate_type, aggregate_id, event_type, payload, headers, partition_key, n)
 ORDER BY m.n
RETURNING id, seq
