#!/usr/bin/env bash
# Every measurement of docs/benchmarks.md's target table, one after the
# other, as JSON lines into the directory $1 (default ./bench-results).
# Needs DATABASE_URL (a user with CREATEDB) and REDIS_URL; OUTBOX = the binary.
set -euo pipefail
OUTBOX=${OUTBOX:-outbox}
out=${1:-bench-results}
mkdir -p "$out"
b() { local name=$1; shift; echo "== $name: outbox bench $*" >&2; "$OUTBOX" bench "$@" --json > "$out/$name.json"; }
b lat200    latency --rate 200 --n 2000 --runs 3
b lat1000   latency --rate 1000 --n 5000 --runs 3
b drain1    drain --n 200000 --relays 1 --runs 3
b drain2    drain --n 200000 --relays 2 --runs 3
b consume1  consume --n 100000 --consumers 1 --runs 3
b consume2  consume --n 100000 --consumers 2 --runs 3
b sustained sustained --rate 2500 --duration 60s
b drain1m   drain --n 1000000 --relays 1
b writers   writers --writers 1,8,32 --duration 6s --runs 3
