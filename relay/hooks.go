package relay

import (
	"context"

	"github.com/tedbank/outbox/internal/hooks"
)

// The single steps, for the project's tests (internal/relaytest).
func init() {
	hooks.RelayDrainBatch = func(ctx context.Context, r any) (any, error) { return r.(*Relay).stepDrainBatch(ctx) }
	hooks.RelayReap = func(ctx context.Context, r any) (int, error) { return r.(*Relay).stepReap(ctx) }
}
