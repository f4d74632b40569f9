#!/usr/bin/env bash
# What the relay's claim costs, statement by statement (docs/benchmarks.md,
# "Where a batch's time goes"): a 200,000-row backlog of 1,000 senders, then
# pgbench runs each claim variant in a transaction it rolls back (so every run
# claims the same 500 rows), alternating, ROUNDS times:
#   shipped    sql/queries/relay_claim.sql (the per-key gate: one probe per row)
#   no-gate    the same without the gate (what order would be lost)
#   anti-join  no probe: keys blocked by retrying rows (needs the partial index
#              it creates), one row per key per batch
#   read-only  a plain read of the 500 rows: what a relay that owns its
#              partitions (lease + fencing token) would do instead of claiming
#
#   DATABASE_URL=postgres://root@127.0.0.1:5432/postgres scripts/claim-cost.sh
set -euo pipefail
cd "$(dirname "$0")/.."
base=${DATABASE_URL:?set DATABASE_URL (a user with CREATEDB)}
rounds=${ROUNDS:-3}
db=claimcost_$$
url=${base%/*}/$db
psql -q "$base" -c "CREATE DATABASE $db"
trap 'psql -q "$base" -c "DROP DATABASE IF EXISTS $db" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
tmp=$(mktemp -d)
go run ./cmd/outbox migrate --database-url "$url" >/dev/null
psql -q "$url" -f scripts/claim-cost/setup.sql
psql -q "$url" -c "CREATE INDEX claimcost_retrying ON outbox_messages ((coalesce(partition_key, aggregate_id))) WHERE unpublished AND attempts > 0" -c "ANALYZE outbox_messages"
sed -e 's/\$1/500/; s/\$3/'"'"'exp'"'"'/; s/\$2/gen_random_uuid()/' sql/queries/relay_claim.sql | grep -v '^--' > "$tmp/shipped.sql"
for v in no-gate anti-join read-only; do cp "scripts/claim-cost/$v.sql" "$tmp/$v.sql"; done
for v in shipped no-gate anti-join read-only; do
  printf 'BEGIN;\n%s;\nROLLBACK;\n' "$(cat "$tmp/$v.sql")" > "$tmp/txn-$v.sql"
done
for r in $(seq "$rounds"); do
  for v in shipped no-gate anti-join read-only; do
    psql -q "$url" -c "VACUUM outbox_messages"
    printf 'round %s %-10s ' "$r" "$v"
    pgbench -n -f "$tmp/txn-$v.sql" -t 60 -c 1 "$url" 2>/dev/null | grep 'latency average'
  done
done
