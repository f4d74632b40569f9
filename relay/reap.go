package relay

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	outboxsql "github.com/tedbank/outbox/sql"
)

// Reap returns expired claims to pending and reports how many it returned.
func (r *Relay) Reap(ctx context.Context) (int, error) { return r.reap(ctx, r.cfg.Lease) }

// reap returns the claims older than lease to pending.
func (r *Relay) reap(ctx context.Context, lease time.Duration) (int, error) {
	total := 0
	for {
		// Bounded: a half-open connection must not hang the reaper (and
		// with it the relay's shutdown) until TCP gives up.
		sctx, cancel := context.WithTimeout(ctx, claimTimeout)
		tag, err := r.exec(sctx, outboxsql.RelayReap(lease.Milliseconds(), r.cfg.BatchSize, r.cfg.MaxAttempts))
		cancel()
		if err != nil {
			return total, fmt.Errorf("reap: %w", err)
		}
		n := int(tag.RowsAffected())
		total += n
		if n < r.cfg.BatchSize {
			break
		}
	}
	r.stats.reaped.Add(int64(total))
	r.cfg.Metrics.reapedRows(total)
	return total, nil
}

func (r *Relay) reapLoop(ctx context.Context) {
	t := time.NewTicker(r.cfg.ReapInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n, err := r.Reap(ctx)
		switch {
		case err != nil && ctx.Err() == nil:
			r.log.Warn("reaper failed", slog.Any("error", err))
		case n > 0:
			r.log.Warn("returned expired claims to pending", slog.Int("rows", n))
			r.kick()
		}
	}
}
