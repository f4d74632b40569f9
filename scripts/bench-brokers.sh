#!/usr/bin/env bash
# The brokers' figures, in one session: Redis Streams against NATS JetStream
# (drain, consume, commit -> verdict latency) and the PostgreSQL inbox
# against anti-fraud's Lua scripts (consume), each case --runs 3 (medians).
# Needs DATABASE_URL (a user allowed to CREATE DATABASE), REDIS_URL and
# NATS_URL (nats-server -js). Prints one JSON line per result.
set -euo pipefail
bin=${OUTBOX:-bin/outbox}
runs=${RUNS:-3}
for round in 1 2; do
  for broker in redis nats; do
    "$bin" bench drain --n 20000 --runs "$runs" --broker "$broker" --json
  done
  for effect in lua inbox; do
    for broker in redis nats; do
      "$bin" bench consume --n 20000 --runs "$runs" --broker "$broker" --effect "$effect" --json
    done
  done
  for broker in redis nats; do
    "$bin" bench latency --n 2000 --rate 200 --runs "$runs" --broker "$broker" --json
  done
done
