// Package hooks reaches single steps of the relay and the consumer that are
// not part of their API: one batch drained, one reaper pass, one read. The project's tests drive a relay or a consumer by hand with them
// (through internal/relaytest and internal/consumertest); a service runs Run.
// The packages set the functions when they are initialized; the values are
// *relay.Relay and *consumer.Consumer, which this package cannot name.
package hooks

import "context"

// The relay's steps (package relay sets them).
var (
	// RelayDrainBatch claims one batch, publishes it and records the
	// outcome; its result is a relay.BatchResult.
	RelayDrainBatch func(ctx context.Context, r any) (any, error)
	// RelayReap returns expired claims to pending: how many.
	RelayReap func(ctx context.Context, r any) (int, error)
)

// The consumer's steps (package consumer sets them), Redis Streams only,
// without partition ownership.
var (
	ConsumerReadNew        func(ctx context.Context, c any) (int, error)
	ConsumerProcessPending func(ctx context.Context, c any) error
	ConsumerClaimIdle      func(ctx context.Context, c any) (int, error)
)
