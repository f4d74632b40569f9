#!/usr/bin/env bash
# A stalled relay: two relays, TEDs at 100/s for 25 s, one relay
# SIGSTOPped 5 s in for 15 s (a VM pause, a long GC, swap: its connections
# stay open), then SIGCONT. Prints, per ownership, how many events waited
# over 1 s from their commit to their publication (published_at, set with
# the mark after the XADD) and the slowest. Give it a binary to compare builds
# (default: this tree's).
#
#   PG=postgres://postgres@127.0.0.1:5432 REDIS_URL=redis://127.0.0.1:6379/0 scripts/stall.sh [outbox-binary]
#
# It creates and drops the database stall_relay and deletes its streams
# (keys stall-relay:*); needs psql and redis-cli.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-}
if [ -z "$BIN" ]; then
  go build -o /tmp/outbox-stall ./cmd/outbox
  BIN=/tmp/outbox-stall
fi
PG=${PG:-postgres://postgres@127.0.0.1:5432}
export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0}
export DATABASE_URL="$PG/stall_relay?sslmode=disable"
cleanup() { redis-cli -u "$REDIS_URL" --scan --pattern 'stall-relay:*' | xargs -r redis-cli -u "$REDIS_URL" del >/dev/null; }
for ownership in rows partitions; do
  psql "$PG/postgres" -qc "DROP DATABASE IF EXISTS stall_relay" -qc "CREATE DATABASE stall_relay" >/dev/null
  cleanup
  "$BIN" migrate >/dev/null 2>&1
  relay() { "$BIN" relay --name "$1" --ownership "$ownership" --stream-prefix stall-relay:outbox.event. --log-level warn >>"/tmp/stall-$1.log" 2>&1 & }
  relay a
  a=$!
  relay b
  b=$!
  sleep 2
  "$BIN" settle --count 2500 --rate 100 >/dev/null 2>&1 &
  settle=$!
  sleep 5
  kill -STOP "$a"
  sleep 15
  kill -CONT "$a"
  wait "$settle" || true
  for _ in $(seq 300); do
    [ "$(psql "$DATABASE_URL" -tAc "SELECT count(*) FROM outbox_messages WHERE status <> 'published'")" = 0 ] && break
    sleep 0.1
  done
  psql "$DATABASE_URL" -tAc "SELECT '$ownership: ' || count(*) || ' events, ' || count(*) FILTER (WHERE published_at - created_at > interval '1 second')
    || ' over 1 s, the slowest ' || round(extract(epoch FROM max(published_at - created_at))::numeric, 3) || ' s'
    FROM outbox_messages WHERE status = 'published'"
  kill "$a" "$b"
  wait "$a" "$b" || true
  cleanup
done
psql "$PG/postgres" -qc "DROP DATABASE stall_relay" >/dev/null
