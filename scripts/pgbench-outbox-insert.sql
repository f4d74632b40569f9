-- One outbox insert per transaction, as the notify-trigger cost was measured in
-- docs/benchmarks.md: pgbench -n -c 32 -j 2 -T 4 -f scripts/pgbench-outbox-insert.sql <db>
-- with SELECT outbox_notify_mode(...) and SELECT outbox_relay_busy() set before each run.
BEGIN;
INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload) VALUES ('transfer', gen_random_uuid()::text, 'transfer.settled', '{"a":1,"b":"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}');
COMMIT;
