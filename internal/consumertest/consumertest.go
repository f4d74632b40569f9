// Package consumertest drives a consumer by hand in the project's tests:
// the single steps of Run (Redis Streams only, without partition
// ownership), which are not part of package consumer's API.
package consumertest

import (
	"context"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/internal/hooks"
)

// ReadNew blocks up to the consumer's Block for new entries of every
// partition and processes them: how many it read.
func ReadNew(ctx context.Context, c *consumer.Consumer) (int, error) {
	return hooks.Call[*consumer.Consumer, int](ctx, hooks.ConsumerReadNew, c)
}

// ProcessPending re-reads and processes the consumer's own pending entries.
func ProcessPending(ctx context.Context, c *consumer.Consumer) error {
	_, err := hooks.Call[*consumer.Consumer, struct{}](ctx, hooks.ConsumerProcessPending, c)
	return err
}

// ClaimIdle claims the entries idle for at least the consumer's
// ClaimMinIdle and processes them: how many it claimed.
func ClaimIdle(ctx context.Context, c *consumer.Consumer) (int, error) {
	return hooks.Call[*consumer.Consumer, int](ctx, hooks.ConsumerClaimIdle, c)
}
