#!/usr/bin/env bash
# A/B drain throughput: one relay publishes 50,000 pending events, with the
# schema as migrated (A) and with the UNIQUE(seq) constraint dropped (B), three
# alternating rounds on the same servers. Prints "round variant events/s".
#
#   PG=postgres://postgres@127.0.0.1:5432 REDIS_URL=redis://127.0.0.1:6379/6 scripts/drain-ab.sh
#
# It creates and drops the databases drain_a and drain_b; needs psql and redis-cli.
set -euo pipefail
cd "$(dirname "$0")/.."
go build -o /tmp/outbox-drain-ab ./cmd/outbox
B=/tmp/outbox-drain-ab
PG=${PG:-postgres://postgres@127.0.0.1:5432}
REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/6}
for round in 1 2 3; do
 for v in A B; do
  db=drain_$(echo $v | tr A-Z a-z)
  psql $PG/postgres -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db" 2>/dev/null
  url="$PG/$db?sslmode=disable"
  DATABASE_URL=$url $B migrate >/dev/null 2>&1
  [ $v = B ] && psql "$url" -qc "ALTER TABLE outbox_messages DROP CONSTRAINT outbox_messages_seq_unique"
  psql "$url" -qc "INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload)
     SELECT 'transfer', 'agg-' || g, 'transfer.settled', jsonb_build_object('n', g, 'pad', repeat('x', 200)) FROM generate_series(1, 50000) g" -c "VACUUM ANALYZE outbox_messages"
  redis-cli -u "$REDIS_URL" DEL drain:transfer >/dev/null
  start=$(date +%s.%N)
  DATABASE_URL=$url REDIS_URL=$REDIS_URL $B relay --log-level error --stream-prefix drain: --poll 100ms &
  pid=$!
  until [ "$(psql "$url" -Atc "SELECT count(*) FROM outbox_messages WHERE status <> 'published'")" = 0 ]; do sleep 0.2; done
  end=$(date +%s.%N); kill $pid; wait $pid 2>/dev/null || true
  echo "$round $v $(python3 -c "print(round(50000/($end-$start)))")"
  psql $PG/postgres -qc "DROP DATABASE $db WITH (FORCE)"
 done
done
