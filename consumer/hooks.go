package consumer

import (
	"context"

	"github.com/tedbank/outbox/internal/hooks"
)

// The single steps, for the project's tests (internal/consumertest).
func init() {
	hooks.ConsumerReadNew = func(ctx context.Context, c any) (int, error) { return c.(*Consumer).stepReadNew(ctx) }
	hooks.ConsumerProcessPending = func(ctx context.Context, c any) error { return c.(*Consumer).stepProcessPending(ctx) }
	hooks.ConsumerClaimIdle = func(ctx context.Context, c any) (int, error) { return c.(*Consumer).stepClaimIdle(ctx) }
}
