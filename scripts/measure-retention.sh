#!/usr/bin/env bash
# Measures how outbox_messages and its indexes behave over a long run, with
# and without batched cleanup of published rows, and with and without a
# VACUUM after each round (standing in for autovacuum, in case the server has
# it off): table and index size, dead tuples, and the latency of the relay's
# claim query. Each round inserts
# ROWS events and lets a real relay publish them.
#
#   DATABASE_URL=postgres://... REDIS_URL=redis://... scripts/measure-retention.sh [ROUNDS] [ROWS]
#
# It creates and drops its own databases (outbox_retention_*) on that server
# and its own Redis stream prefix; it needs psql and redis-cli.
set -euo pipefail
ROUNDS=${1:-6}
ROWS=${2:-50000}
: "${DATABASE_URL:?set DATABASE_URL (a superuser URL; the script creates databases)}"
: "${REDIS_URL:?set REDIS_URL}"
cd "$(dirname "$0")/.."
go build -o /tmp/outbox-measure ./cmd/outbox
base=${DATABASE_URL%%\?*}; base=${base%/*}; query=""; [[ $DATABASE_URL == *\?* ]] && query="?${DATABASE_URL#*\?}"
prefix="measure-$$:"

claim_sql="BEGIN; EXPLAIN (ANALYZE, FORMAT JSON) $(sed -e 's/\$1/500/' -e "s/\$2/gen_random_uuid()/" -e "s/\$3/'measure'/" sql/queries/relay_claim.sql | grep -v '^--'); ROLLBACK;"

run() { # variant: keep | delete | keep+vacuum | delete+vacuum
  local variant=$1 db="outbox_retention_${1/+/_}"
  psql "$DATABASE_URL" -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db" >/dev/null
  local url="$base/$db$query"
  DATABASE_URL=$url /tmp/outbox-measure migrate >/dev/null 2>&1
  DATABASE_URL=$url REDIS_URL=$REDIS_URL /tmp/outbox-measure relay --ownership rows --log-level error --stream-prefix "$prefix" &
  local relay=$!
  trap "kill $relay 2>/dev/null || true" EXIT
  echo "| $variant | round | rows in table | table MB | indexes MB | dead tuples | claim ms (500 pending) | cleanup s |"
  echo "|---|---|---|---|---|---|---|---|"
  for r in $(seq 1 "$ROUNDS"); do
    psql "$url" -qc "INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload)
      SELECT 'transfer', 'agg-' || g, 'transfer.settled', jsonb_build_object('n', g, 'pad', repeat('x', 200))
      FROM generate_series(1, $ROWS) g" >/dev/null
    until [ "$(psql "$url" -Atc "SELECT count(*) FROM outbox_messages WHERE status <> 'published'")" = 0 ]; do sleep 0.5; done
    redis-cli -u "$REDIS_URL" DEL "${prefix}transfer" >/dev/null
    local took=0
    if [[ $variant == delete* ]]; then
      local t0=$(date +%s.%N)
      psql "$url" -qc "DO \$\$ DECLARE n int; BEGIN LOOP
          DELETE FROM outbox_messages WHERE id IN (SELECT id FROM outbox_messages WHERE status = 'published'
            AND published_at < now() LIMIT 5000 FOR UPDATE SKIP LOCKED);
          GET DIAGNOSTICS n = ROW_COUNT; COMMIT; EXIT WHEN n < 5000; END LOOP; END \$\$" >/dev/null
      took=$(python3 -c "print(round($(date +%s.%N) - $t0, 2))")
    fi
    if [[ $variant == *vacuum ]]; then
      psql "$url" -qc "VACUUM outbox_messages" # what autovacuum does when it is on
    fi
    # Claim latency with 500 claimable rows, measured without publishing them.
    kill -STOP $relay
    psql "$url" -qc "INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload)
      SELECT 'probe', 'p-' || g, 'probe', '{}' FROM generate_series(1, 500) g" >/dev/null
    local ms
    ms=$(psql "$url" -At -c "$claim_sql" | python3 -c 'import json,sys; t=sys.stdin.read(); i=t.index("["); print(round(json.loads(t[i:t.rindex("]")+1])[0]["Execution Time"],2))')
    psql "$url" -qc "DELETE FROM outbox_messages WHERE aggregate_type = 'probe'" >/dev/null
    kill -CONT $relay
    read -r rows tbl idx dead < <(psql "$url" -At -F' ' -c "SELECT (SELECT count(*) FROM outbox_messages),
      round(pg_relation_size('outbox_messages')/1048576.0, 1), round(pg_indexes_size('outbox_messages')/1048576.0, 1),
      n_dead_tup FROM pg_stat_user_tables WHERE relname = 'outbox_messages'")
    echo "| $variant | $r | $rows | $tbl | $idx | $dead | $ms | $took |"
  done
  kill -TERM $relay; wait $relay 2>/dev/null || true
  psql "$DATABASE_URL" -qc "DROP DATABASE $db WITH (FORCE)" >/dev/null
}
for v in ${VARIANTS:-keep delete keep+vacuum delete+vacuum}; do run "$v"; done
