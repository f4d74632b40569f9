#!/bin/bash
# Reconcile speed: N transfers (default 1,000,000), each with a published event
# and a verdict, 1000 senders, written straight into a scratch database "recperf"
# on the local PostgreSQL (root, trust) and Redis db 13; then outbox reconcile
# three times. Needs bin/outbox (make build), psql and redis-cli.
set -e
N=${1:-1000000}
DB=recperf
psql -h 127.0.0.1 -U root -d postgres -qc "DROP DATABASE IF EXISTS $DB" -c "CREATE DATABASE $DB"
cd "$(dirname "$0")/.."
bin/outbox migrate --database-url postgres://root@127.0.0.1:5432/$DB >/dev/null 2>&1
psql -h 127.0.0.1 -U root -d $DB -q <<SQL
SET synchronous_commit = off;
ALTER TABLE outbox_messages DISABLE TRIGGER USER;
CREATE TEMP TABLE g AS SELECT i, gen_random_uuid() AS id FROM generate_series(1, $N) i;
INSERT INTO transfers (id, from_account, to_account, amount_cents)
  SELECT id, 'acct-' || (i % 1000), 'dest-' || (i % 7), 100 + (i % 5000) FROM g;
INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, status, published_at, stream_id)
  SELECT 'transfer', id::text, 'transfer.settled', '{}', 'published', now(), i || '-0' FROM g;
ALTER TABLE outbox_messages ENABLE TRIGGER USER;
ANALYZE;
SQL
redis-cli -n 13 flushdb >/dev/null
# verdicts and daily totals, as anti-fraud writes them (fraud/effect.lua),
# expiring with the default retention (7 days after the settlement day)
DAY="to_char(settled_at AT TIME ZONE 'UTC', 'YYYY-MM-DD')"
DAYNO="floor(extract(epoch FROM settled_at) / 86400)::bigint"
EXP="((($DAYNO + 1) * 86400 + 7 * 86400) * 1000)"
psql -h 127.0.0.1 -U root -d $DB -At -F ' ' -c "SELECT 'SET fraud:verdict:' || id || ' approve PXAT ' || $EXP FROM transfers" | redis-cli -n 13 --pipe >/dev/null
psql -h 127.0.0.1 -U root -d $DB -At -c "SELECT 'HSET fraud:day:' || $DAY || ':account:' || from_account || ' sent_cents ' || sum(amount_cents) || ' transfers ' || count(*) FROM transfers GROUP BY from_account, $DAY" | redis-cli -n 13 --pipe >/dev/null
psql -h 127.0.0.1 -U root -d $DB -At -c "SELECT DISTINCT 'ZADD fraud:days ' || $DAYNO || ' ' || $DAY FROM transfers" | redis-cli -n 13 --pipe >/dev/null
echo "data ready: $N"
for run in 1 2 3; do
  /usr/bin/time -f "run $run: %e s wall, %M KB max RSS" bin/outbox reconcile --database-url postgres://root@127.0.0.1:5432/$DB --redis-url redis://127.0.0.1:6379/13 --since 1h --grace 0s --json | python3 -c "import json,sys; r=json.load(sys.stdin); print({k:r[k] for k in ['transfers','events','senders','totals_differ','ok']})"
done
psql -h 127.0.0.1 -U root -d postgres -qc "DROP DATABASE $DB"; redis-cli -n 13 flushdb >/dev/null
