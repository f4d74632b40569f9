#!/usr/bin/env bash
# Start a throw-away Redis Cluster on this machine: 3 masters and 3 replicas
# (redis-server with cluster-enabled yes, joined by redis-cli --cluster create
# --cluster-replicas 1), the way the tests and benchmarks run one.
#
#   scripts/redis-cluster.sh start [first-port]   # default 7000: ports 7000..7005
#   scripts/redis-cluster.sh stop  [first-port]
#
# 'start' prints the URL to give the outbox commands, in go-redis's cluster form:
#   REDIS_CLUSTER=true REDIS_URL='redis://127.0.0.1:7000?addr=127.0.0.1:7001&...' outbox relay --partitions 16
# Files live in /tmp/outbox-redis-cluster-<first-port>; 'stop' removes them.
set -euo pipefail
cmd=${1:-start}
base=${2:-7000}
dir=/tmp/outbox-redis-cluster-$base
ports=$(seq "$base" $((base + 5)))

case $cmd in
start)
  mkdir -p "$dir"
  for p in $ports; do
    mkdir -p "$dir/$p"
    redis-server --port "$p" --bind 127.0.0.1 --dir "$dir/$p" --daemonize yes \
      --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 2000 \
      --appendonly yes --appendfsync always --maxmemory-policy noeviction \
      --logfile "$dir/$p/redis.log" --pidfile "$dir/$p/redis.pid" >/dev/null
  done
  for p in $ports; do
    for _ in $(seq 50); do redis-cli -p "$p" ping >/dev/null 2>&1 && break; sleep 0.1; done
  done
  addrs=()
  for p in $ports; do addrs+=("127.0.0.1:$p"); done
  redis-cli --cluster create "${addrs[@]}" --cluster-replicas 1 --cluster-yes >/dev/null
  for _ in $(seq 100); do
    redis-cli -p "$base" cluster info | grep -q 'cluster_state:ok' && break
    sleep 0.1
  done
  url="redis://127.0.0.1:$base?"
  for p in $(seq $((base + 1)) $((base + 5))); do url+="addr=127.0.0.1:$p&"; done
  echo "${url%&}"
  ;;
stop)
  for p in $ports; do redis-cli -p "$p" shutdown nosave >/dev/null 2>&1 || true; done
  rm -rf "$dir"
  ;;
*)
  echo "usage: $0 start|stop [first-port]" >&2
  exit 2
  ;;
esac
