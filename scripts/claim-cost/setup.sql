TRUNCATE outbox_messages;
INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, partition_key)
SELECT 'transfer', gen_random_uuid()::text, 'transfer.settled',
       jsonb_build_object('schema_version',1,'amount_cents', (i*7919)%200000, 'from_account', 'acct-'||(i%1000), 'to_account','acct-x','currency','BRL'),
       'acct-' || (i % 1000)
  FROM generate_series(1, 200000) i;
VACUUM ANALYZE outbox_messages;
