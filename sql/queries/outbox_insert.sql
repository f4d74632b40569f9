-- Insert outbox messages given as parallel arrays (one element per message).
INSERT INTO outbox_messages (id, aggregate_type, aggregate_id, event_type, payload, headers)
SELECT m.id, m.aggregate_type, m.aggregate_id, m.event_type, m.payload, m.headers
  FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::jsonb[], $6::jsonb[])
       WITH ORDINALITY AS m(id, aggregate_type, aggregate_id, event_type, payload, headers, n)
 ORDER BY m.n
RETURNING id, seq
