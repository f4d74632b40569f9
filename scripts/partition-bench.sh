#!/usr/bin/env bash
# Drain and consume figures with partitions (docs/benchmarks.md, "Partitions"):
# a 200k backlog drained and 100k entries consumed with P = 1, 4, 16, by one
# and two relays / consumers, on one Redis and on a local 3-master Redis
# Cluster (scripts/redis-cluster.sh), and the build before partitions as the
# baseline, all in one run. Needs DATABASE_URL and REDIS_URL (one Redis), and
# OLD=path/to/an/outbox/binary of the earlier build.
#   scripts/partition-bench.sh > partition-bench.jsonl
set -euo pipefail
cd "$(dirname "$0")/.."
go build -o /tmp/outbox-partition-bench ./cmd/outbox
new=/tmp/outbox-partition-bench
old=${OLD:?set OLD to the outbox binary of the build to compare with}
cluster_url=$(scripts/redis-cluster.sh start 7100)
trap 'scripts/redis-cluster.sh stop 7100' EXIT

run() { # label, binary, args...: one JSON line, or one with the error
  local label=$1 bin=$2; shift 2
  local out err
  err=$(mktemp)
  if out=$("$bin" bench "$@" --json 2>"$err"); then
    echo "$out" | sed "s/^{/{\"label\":\"$label\",/"
  else
    printf '{"label":"%s","args":"%s","error":"%s"}\n' "$label" "$*" "$(tail -1 "$err" | tr -d '"\\')"
  fi
  rm -f "$err"
}
for k in 1 2; do
  run "old" "$old" drain --n 200000 --relays $k
  run "old" "$old" consume --n 100000 --consumers $k
  for p in 1 4 16; do
    run "redis P=$p" "$new" drain --n 200000 --relays $k --partitions $p
    run "redis P=$p" "$new" consume --n 100000 --consumers $k --partitions $p
  done
  for p in 4 16; do
    REDIS_URL=$cluster_url REDIS_CLUSTER=true run "cluster P=$p" "$new" drain --n 200000 --relays $k --partitions $p
    REDIS_URL=$cluster_url REDIS_CLUSTER=true run "cluster P=$p" "$new" consume --n 100000 --consumers $k --partitions $p
  done
done
