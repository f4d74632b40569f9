#!/usr/bin/env bash
# Big payloads: a SQL writer's burst of 200 events of 5 MB each,
# then 5 TEDs of other keys; one relay (default ownership) started on the
# backlog. Prints when the 5 TEDs were published, when all 205 were, and the
# relay's peak RSS. Give it a binary to compare builds (default: this tree's).
#
#   PG=postgres://postgres@127.0.0.1:5432 REDIS_URL=redis://127.0.0.1:6379/0 scripts/big-payloads.sh [outbox-binary]
#
# It creates and drops the database big_payloads and deletes its stream
# (keys big-payloads:*); needs psql, redis-cli and bc.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-}
if [ -z "$BIN" ]; then
  go build -o /tmp/outbox-big-payloads ./cmd/outbox
  BIN=/tmp/outbox-big-payloads
fi
PG=${PG:-postgres://postgres@127.0.0.1:5432}
export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0}
export DATABASE_URL="$PG/big_payloads?sslmode=disable"
psql "$PG/postgres" -qc "DROP DATABASE IF EXISTS big_payloads" -qc "CREATE DATABASE big_payloads" >/dev/null
cleanup() { redis-cli -u "$REDIS_URL" --scan --pattern 'big-payloads:*' | xargs -r redis-cli -u "$REDIS_URL" del >/dev/null; }
cleanup
"$BIN" migrate >/dev/null
psql "$DATABASE_URL" -qc "INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload)
  SELECT 'blob', 'b-' || g, 'blob.stored', jsonb_build_object('data', repeat(md5(g::text), 5 * 1024 * 1024 / 32))
    FROM generate_series(1, 200) g"
"$BIN" settle --count 5 >/dev/null
start=$(date +%s.%N)
"$BIN" relay --name big --stream-prefix big-payloads:outbox.event. --log-level warn >/tmp/big-payloads-relay.log 2>&1 &
pid=$!
small=""
total=0
for _ in $(seq 1200); do
  read -r s total < <(psql "$DATABASE_URL" -tAc "SELECT count(*) FILTER (WHERE aggregate_type = 'transfer' AND status = 'published'),
                                                     count(*) FILTER (WHERE status = 'published') FROM outbox_messages" | tr '|' ' ')
  [ -z "$small" ] && [ "$s" = 5 ] && small=$(echo "$(date +%s.%N) - $start" | bc)
  [ "$total" = 205 ] && break
  sleep 0.1
done
all=$(echo "$(date +%s.%N) - $start" | bc)
rss=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status")
kill "$pid"
wait "$pid" || true
echo "the 5 TEDs published after ${small:-never} s; $total of 205 published after $all s; relay peak RSS $rss kB"
cleanup
psql "$PG/postgres" -qc "DROP DATABASE big_payloads" >/dev/null
