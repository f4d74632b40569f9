package consumer

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/tedbank/outbox/consumer/source"
	"github.com/tedbank/outbox/internal/hooks"
)

// The single steps, for the project's tests (internal/consumertest).
func init() {
	hooks.Set(hooks.ConsumerReadNew, func(ctx context.Context, c *Consumer) (int, error) { return c.stepReadNew(ctx) })
	hooks.Set(hooks.ConsumerProcessPending, func(ctx context.Context, c *Consumer) (struct{}, error) {
		return struct{}{}, c.stepProcessPending(ctx)
	})
	hooks.Set(hooks.ConsumerClaimIdle, func(ctx context.Context, c *Consumer) (int, error) { return c.stepClaimIdle(ctx) })
}

// The single steps: Run is how to consume; stepReadNew, stepProcessPending
// and stepClaimIdle apply the partitions of a Redis Streams consumer by
// hand, without partition ownership, for the project's tests
// (internal/consumertest). stepReadNew reads every partition in one
// command, which a Redis Cluster refuses.

// errSingleStepsRedisOnly: the single steps read Redis Streams.
var errSingleStepsRedisOnly = errors.New("consumer: the single steps (read new, process pending, claim idle) read Redis Streams; a consumer of another source consumes with Run")

// stepReader is partition pt's reader for a single step: the partition's
// gate outlives it.
func (c *Consumer) stepReader(pt part) (*streamReader, feed, error) {
	s, ok := c.src.(*streams)
	if !ok {
		return nil, feed{}, errSingleStepsRedisOnly
	}
	f := feed{part: pt, gate: c.gates[pt.n]}
	r := s.reader(source.Partition{Group: c.cfg.Group, Subject: pt.stream, N: pt.n}, f.gate)
	r.takenOver = true
	return r, f, nil
}

// stepReadNew blocks up to Config.Block for new entries of every partition
// and applies them.
func (c *Consumer) stepReadNew(ctx context.Context) (int, error) {
	s, ok := c.src.(*streams)
	if !ok {
		return 0, errSingleStepsRedisOnly
	}
	names := make([]string, 0, 2*len(c.parts))
	for _, pt := range c.parts {
		names = append(names, pt.stream)
	}
	for range c.parts {
		names = append(names, ">")
	}
	res, err := s.xreadgroup(ctx, c.cfg.Group, names, c.cfg.BatchSize, c.cfg.Block)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, xs := range res {
		n += len(xs.Messages)
		i := slices.IndexFunc(c.parts, func(pt part) bool { return pt.stream == xs.Stream })
		if i < 0 {
			return n, fmt.Errorf("consumer: XREADGROUP replied with a stream it was not asked for: %s", xs.Stream)
		}
		r, f, _ := c.stepReader(c.parts[i])
		if err := c.handle(ctx, f, r, r.messages(ctx, xs.Messages, false)); err != nil {
			return n, err
		}
	}
	return n, nil
}

// stepProcessPending re-reads and applies this consumer's own pending
// entries of every partition, from the oldest, until none is left that it
// has not tried in this pass; it returns the last effect that failed.
func (c *Consumer) stepProcessPending(ctx context.Context) error {
	for _, pt := range c.parts {
		r, f, err := c.stepReader(pt)
		if err != nil {
			return err
		}
		r.pass = &pendingPass{cursor: "0", seen: map[entryID]bool{}}
		var failed error
		for ctx.Err() == nil {
			msgs, err := r.pendingPage(ctx)
			if err != nil {
				return err
			}
			if len(msgs) == 0 {
				break
			}
			if err := c.handle(ctx, f, r, msgs); effectFailedOnly(err) {
				failed = err
			} else if err != nil {
				return err
			}
		}
		if failed != nil {
			return failed
		}
	}
	return nil
}

// stepClaimIdle claims the entries of every partition idle for at least
// ClaimMinIdle and applies them. It returns how many it claimed.
func (c *Consumer) stepClaimIdle(ctx context.Context) (int, error) {
	total := 0
	for _, pt := range c.parts {
		r, f, err := c.stepReader(pt)
		if err != nil {
			return 0, err
		}
		var failed error
		for first := true; first || r.claiming; first = false {
			msgs, err := r.claimPage(ctx, c.cfg.ClaimMinIdle)
			if err != nil {
				return total, err
			}
			total += len(msgs)
			if err := c.handle(ctx, f, r, msgs); effectFailedOnly(err) {
				failed = err
			} else if err != nil {
				return total, err
			}
		}
		if failed != nil {
			return total, failed
		}
	}
	return total, nil
}
