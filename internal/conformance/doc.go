// Package conformance is the consumer contract's test suite, written once
// against the public API (outbox/transfer, relay, consumer, consumer/inbox,
// fraud) and run against every combination the project ships: broker
// {Redis Streams, NATS JetStream} x effect {Lua script (anti-fraud),
// PostgreSQL inbox} x relay ownership {rows, partitions} x partitions
// {1, 4}. Each combination runs one load of TEDs through two relays and two
// consumers while faults production meets every day strike: a transient
// handler failure on one key (a lock timeout on the inbox, a WRONGTYPE on
// the Lua path), a consumer owner cut from its lease store only (Redis)
// while the broker and its effects' store stay reachable, past its name's
// lease too, with a supervisor's replacement started under its name and the
// stalled one coming back while events flow (it must stand down), a twin
// started under a live consumer's name, relays killed between publish and mark
// (their rows left 'publishing', published again by the others), a
// consumer crashed holding partitions and pending entries, and, with
// P = 4, the documented change from P = 1 midway (with a relay killed
// between its publish and its mark under the old layout). It then checks
// the contract: no event lost, each applied exactly once, each key's events
// applied in commit order. The P = 4 combinations' relays also write the
// CloudEvents attributes (relay.Config.CloudEvents), which the consumers
// read past.
//
// A broker, effect path or mode is done only when this suite runs it
// (make test runs it; CONFORMANCE_ONLY=<name> runs one combination).
package conformance
