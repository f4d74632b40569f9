#!/usr/bin/env bash
# Redis memory of the whole pipeline (settle -> relay -> anti-fraud) per TED:
# settles N TEDs (default 1,000,000) among A sender accounts (default
# 100,000) into a scratch database, lets a relay and an anti-fraud consumer
# with default settings carry them, and reports what Redis holds afterwards:
# used memory, keys by kind, and the average MEMORY USAGE of each kind of key
# (sampled). docs/operations.md "Redis memory" has the results.
#
#   DATABASE_URL=postgres://... REDIS_URL=redis://127.0.0.1:6379/12 scripts/redis-memory.sh [N] [A]
#
# The Redis database in REDIS_URL is flushed before and after: give it one
# nothing else uses. The script creates and drops the database outbox_redismem
# on DATABASE_URL's server; it needs psql and redis-cli.
set -euo pipefail
N=${1:-1000000}
A=${2:-100000}
: "${DATABASE_URL:?set DATABASE_URL (a superuser URL; the script creates a database)}"
: "${REDIS_URL:?set REDIS_URL to a Redis database the script may flush}"
cd "$(dirname "$0")/.."
go build -o /tmp/outbox-redismem ./cmd/outbox
base=${DATABASE_URL%%\?*}; base=${base%/*}; query=""; [[ $DATABASE_URL == *\?* ]] && query="?${DATABASE_URL#*\?}"
db=outbox_redismem
url="$base/$db$query"
rc() { redis-cli -u "$REDIS_URL" "$@"; }
psql "$DATABASE_URL" -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db" >/dev/null
/tmp/outbox-redismem migrate --database-url "$url" >/dev/null
rc flushdb >/dev/null
before=$(rc info memory | awk -F: '/^used_memory:/ {print $2+0}')

export DATABASE_URL=$url REDIS_URL
/tmp/outbox-redismem relay --name mem-r1 --log-level error &
relay=$!
/tmp/outbox-redismem fraud --consumer mem-c1 --log-level error &
fraud=$!
trap 'kill $relay $fraud 2>/dev/null || true' EXIT
start=$(date +%s)
/tmp/outbox-redismem settle --count "$N" --accounts "$A" --concurrency 16 --json >/tmp/redismem-settle.json
until [ "$(rc hget fraud:stats verdicts)" -ge "$N" ] 2>/dev/null; do
  sleep 2
done
echo "$N TEDs settled, published and judged in $(( $(date +%s) - start )) s"
kill $relay $fraud; wait $relay $fraud 2>/dev/null || true
trap - EXIT

after=$(rc info memory | awk -F: '/^used_memory:/ {print $2+0}')
echo "used_memory: $before -> $after bytes: $(( (after - before) / 1024 / 1024 )) MiB for $N TEDs, $(( (after - before) / N )) bytes per TED"
echo "keys: $(rc dbsize)"
for kind in 'fraud:seen:*' 'fraud:verdict:*' 'fraud:day:*:account:*' 'fraud:day:*:accounts' 'fraud:window:*'; do
  rc --scan --pattern "$kind" >/tmp/redismem-keys.txt
  count=$(wc -l </tmp/redismem-keys.txt)
  avg=$(head -1000 /tmp/redismem-keys.txt | sed 's/^/MEMORY USAGE /' | rc | awk '{s += $1; n++} END {if (n) print int(s / n); else print 0}')
  ttl=$(head -1 /tmp/redismem-keys.txt | xargs -r redis-cli -u "$REDIS_URL" pttl)
  echo "$kind: $count keys, $avg bytes each (MEMORY USAGE, mean of up to 1000), expires in ${ttl:-?} ms"
done
for k in outbox.event.transfer fraud:alerts fraud:stats fraud:days; do
  echo "$k: $(rc type $k), $(rc memory usage $k) bytes"
done
echo "outbox.event.transfer entries: $(rc xlen outbox.event.transfer) (trimmed once acknowledged and older than --stream-retention, 1h)"
rc info memory | grep -E '^used_memory_(dataset|overhead):' 
rc flushdb >/dev/null
psql "$base/postgres$query" -qc "DROP DATABASE $db WITH (FORCE)" >/dev/null
