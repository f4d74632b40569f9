#!/usr/bin/env bash
# Writer cost of each notify mode: settle throughput at C concurrent writers
# with a relay running, modes alternating, R rounds. Prints one line per run
# and the medians. Needs DATABASE_URL (a scratch database; it is migrated and
# its outbox grows) and REDIS_URL; OUTBOX=path of the outbox binary.
set -euo pipefail
OUTBOX=${OUTBOX:-outbox}
COUNT=${COUNT:-8000}
CONC=${CONC:-32}
ROUNDS=${ROUNDS:-3}
MODES=${MODES:-off always idle}
"$OUTBOX" migrate >/dev/null 2>&1
"$OUTBOX" relay --name writers-ab --log-level warn &
relay=$!
trap 'kill $relay 2>/dev/null; wait $relay 2>/dev/null' EXIT
sleep 1
declare -A runs
for round in $(seq "$ROUNDS"); do
  for mode in $MODES; do
    psql "$DATABASE_URL" -qAtc "SELECT outbox_notify_mode('$mode')" >/dev/null
    r=$("$OUTBOX" settle --count "$COUNT" --concurrency "$CONC" --json 2>/dev/null | tail -1 |
        python3 -c 'import json,sys; d=json.load(sys.stdin); print(round(d["per_second"]))')
    echo "round $round mode $mode: $r tx/s"
    runs[$mode]+="$r "
  done
done
psql "$DATABASE_URL" -qAtc "SELECT outbox_notify_mode('idle')" >/dev/null
for mode in $MODES; do
  echo "median $mode: $(echo ${runs[$mode]} | tr ' ' '\n' | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}') tx/s (runs: ${runs[$mode]})"
done
