package relaytest

import (
	"context"

	"github.com/tedbank/outbox/internal/hooks"
	"github.com/tedbank/outbox/relay"
)

// DrainBatch claims one batch, publishes it and records the outcome, as a
// running relay's drain does once (it must not be called while Run runs).
// It is not part of package relay's API: a service runs Run.
func DrainBatch(ctx context.Context, r *relay.Relay) (relay.BatchResult, error) {
	res, err := hooks.RelayDrainBatch(ctx, r)
	return res.(relay.BatchResult), err
}

// Reap returns expired claims to pending, as one pass of the relay's
// reaper: how many it returned.
func Reap(ctx context.Context, r *relay.Relay) (int, error) { return hooks.RelayReap(ctx, r) }
