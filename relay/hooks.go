package relay

import (
	"context"

	"github.com/tedbank/outbox/internal/hooks"
	"github.com/tedbank/outbox/internal/testsignal"
)

// The single steps, for the project's tests (internal/relaytest).
func init() {
	hooks.Set(hooks.RelayDrainBatch, func(ctx context.Context, r *Relay) (BatchResult, error) { return r.stepDrainBatch(ctx) })
	hooks.Set(hooks.RelayReap, func(ctx context.Context, r *Relay) (int, error) { return r.stepReap(ctx) })
	hooks.Set(hooks.RelaySignals, func(_ context.Context, r *Relay) (testsignal.Relay, error) {
		return testsignal.Relay{Idle: &r.loop.idle, Reaped: &r.reaper.reaped}, nil
	})
}
