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

// expire marks dead the events that may have reached the broker longer than
// the redelivery window ago and were never marked published (their
// consumers' dedupe records may be gone), and reports how many.
func (r *Relay) expire(ctx context.Context) (int, error) {
	total := 0
	for {
		sctx, cancel := context.WithTimeout(ctx, claimTimeout)
		tag, err := r.exec(sctx, outboxsql.RelayExpire(r.cfg.RedeliveryWindow().Milliseconds(), r.cfg.BatchSize))
		cancel()
		if err != nil {
			return total, fmt.Errorf("expire: %w", err)
		}
		n := int(tag.RowsAffected())
		total += n
		if n < r.cfg.BatchSize {
			return total, nil
		}
	}
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
		switch n, err := r.expire(ctx); {
		case err != nil && ctx.Err() == nil:
			r.log.Warn("marking events past their redelivery window dead failed", slog.Any("error", err))
		case n > 0:
			r.log.Error("events past their redelivery window marked dead: they may have reached the broker, unmarked, longer ago "+
				"than the consumers' dedupe records are sure to last (outbox dead list; retry only if those records still hold)",
				slog.Int("rows", n), slog.Duration("redelivery_window", r.cfg.RedeliveryWindow()))
			r.kick()
		}
	}
}
