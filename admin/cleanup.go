package admin

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/internal/queries"
)

// DefaultCleanupBatch is how many rows one cleanup statement deletes.
const DefaultCleanupBatch = 1000

// CleanupResult says what Cleanup did.
type CleanupResult struct {
	Deleted int64     `json:"deleted"` // published rows deleted
	Batches int       `json:"batches"` // DELETE statements run (the last one deleted fewer than the batch size)
	Cutoff  time.Time `json:"cutoff"`  // rows published before this (database clock) were eligible
}

// CleanupOptions tunes Cleanup.
type CleanupOptions struct {
	// OlderThan: rows published more than this long ago are deleted. Required.
	OlderThan time.Duration
	// BatchSize is the most rows one statement deletes. Default DefaultCleanupBatch.
	BatchSize int
	// OnBatch, when set, is called after every batch with the totals so far.
	OnBatch func(CleanupResult)
}

// Cleanup deletes published rows whose published_at is more than OlderThan
// before now (one cutoff, taken on the database clock when it starts), in
// batches of BatchSize rows in seq order, each batch its own short
// transaction that skips rows locked by others, until a batch deletes fewer
// than BatchSize rows. Pending, publishing and dead rows are never deleted, and
// relays never write published rows, so it is safe to run while they work.
//
// It checks ctx between batches: on cancellation it returns what it deleted so
// far with ctx's error. Each run is recorded with its cutoff before it deletes
// anything, and with its count at the end (outbox_cleanups, migration 0021):
// package reconcile reads the latest cutoff as the cleanup horizon.
func Cleanup(ctx context.Context, pool *pgxpool.Pool, opt CleanupOptions) (res CleanupResult, retErr error) {
	if opt.OlderThan < time.Microsecond {
		return res, errors.New("cleanup: the age of rows to delete must be at least 1µs")
	}
	if opt.BatchSize < 0 {
		return res, fmt.Errorf("cleanup: batch size %d must be positive", opt.BatchSize)
	}
	if opt.BatchSize == 0 {
		opt.BatchSize = DefaultCleanupBatch
	}
	cutoff := queries.AdminCleanupCutoff(opt.OlderThan.Microseconds())
	if err := pool.QueryRow(ctx, cutoff.SQL, cutoff.Args...).Scan(&res.Cutoff); err != nil {
		return res, fmt.Errorf("cleanup: read the database clock: %w", err)
	}
	// The run's cutoff is recorded (outbox_cleanups) before it deletes
	// anything, so that outbox reconcile knows, even while it runs or after
	// it died, that events published before it may be gone; its count when
	// it ends.
	rec := queries.AdminCleanupRecord(res.Cutoff)
	var run int64
	if err := pool.QueryRow(ctx, rec.SQL, rec.Args...).Scan(&run); err != nil {
		return res, fmt.Errorf("cleanup: record the run (outbox_cleanups) before deleting: %w", err)
	}
	defer func() {
		if res.Deleted == 0 {
			return
		}
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		q := queries.AdminCleanupDone(run, res.Deleted)
		if _, err := pool.Exec(dctx, q.SQL, q.Args...); err != nil {
			retErr = errors.Join(retErr, fmt.Errorf("cleanup deleted %d rows and could not record the count: %w", res.Deleted, err))
		}
	}()
	var after int64
	for {
		if err := ctx.Err(); err != nil {
			return res, fmt.Errorf("cleanup stopped after %d rows: %w", res.Deleted, err)
		}
		var n int64
		q := queries.AdminCleanup(res.Cutoff, after, int64(opt.BatchSize))
		if err := pool.QueryRow(ctx, q.SQL, q.Args...).Scan(&n, &after); err != nil {
			return res, fmt.Errorf("cleanup: delete batch %d (after %d rows): %w", res.Batches+1, res.Deleted, err)
		}
		res.Deleted += n
		res.Batches++
		if opt.OnBatch != nil {
			opt.OnBatch(res)
		}
		if n < int64(opt.BatchSize) {
			return res, nil
		}
	}
}
