package bench

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/partition"
)

// minimalRelay is the baseline the relay's figures are compared with,
// measured in the same run on the same servers: it LISTENs on the outbox's
// channel, and on every notification (or every 50 ms) claims up to 500
// pending rows with FOR UPDATE SKIP LOCKED in one transaction, XADDs them in
// one pipeline, each to its partition's stream, marks them published and
// commits, until a claim comes back short. No per-key order across
// failures, fencing, leases, retries, backoff or wake-up protocol: what any
// relay of this outbox must pay at least. It needs a notify mode that
// always notifies (the idle mode notifies only a relay that says it is
// idle).
type minimalRelay struct {
	pool      *pgxpool.Pool
	rdb       redis.UniversalClient
	prefix    string // the stream prefix
	parts     int
	published atomic.Int64
	listening atomic.Bool
}

const minimalBatch = 500

func (m *minimalRelay) run(ctx context.Context) error {
	conn, err := m.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, "LISTEN outbox_messages"); err != nil {
		return err
	}
	m.listening.Store(true)
	for ctx.Err() == nil {
		n, err := m.drainOnce(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("minimal relay: %w", err)
		}
		if n == minimalBatch {
			continue
		}
		wctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		_, err = conn.Conn().WaitForNotification(wctx)
		cancel()
		if err != nil && !errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil {
			return fmt.Errorf("minimal relay: listen: %w", err)
		}
	}
	return nil
}

// drainOnce claims, publishes and marks one batch; it returns its size.
func (m *minimalRelay) drainOnce(ctx context.Context) (int, error) {
	tx, err := m.pool.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // after Commit, a no-op
	rows, err := tx.Query(ctx, `
		SELECT id::text, aggregate_type, aggregate_id, event_type, payload::text, headers::text,
		       coalesce(partition_key, aggregate_id), created_at
		  FROM outbox_messages
		 WHERE unpublished AND status = 'pending'
		 ORDER BY seq
		 LIMIT $1
		   FOR UPDATE SKIP LOCKED`, minimalBatch)
	if err != nil {
		return 0, err
	}
	var (
		ids, streams []string
		values       [][]any
	)
	for rows.Next() {
		var id, aggType, aggID, evType, payload, headers, key string
		var created time.Time
		if err := rows.Scan(&id, &aggType, &aggID, &evType, &payload, &headers, &key, &created); err != nil {
			rows.Close()
			return 0, err
		}
		ids = append(ids, id)
		streams = append(streams, partition.Stream(m.prefix+aggType, partition.Of(key, m.parts), m.parts))
		values = append(values, []any{"event_id", id, "event_type", evType, "aggregate_type", aggType, "aggregate_id", aggID,
			"payload", payload, "headers", headers, "occurred_at", created.Format(time.RFC3339Nano)})
	}
	if err := rows.Err(); err != nil {
		return 0, err
	}
	if len(ids) == 0 {
		return 0, tx.Commit(ctx)
	}
	cmds := make([]*redis.StringCmd, len(ids))
	if _, err := m.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i := range ids {
			cmds[i] = p.XAdd(ctx, &redis.XAddArgs{Stream: streams[i], Values: values[i]})
		}
		return nil
	}); err != nil {
		return 0, err
	}
	streamIDs := make([]string, len(ids))
	for i, c := range cmds {
		streamIDs[i] = c.Val()
	}
	if _, err := tx.Exec(ctx, `
		UPDATE outbox_messages o
		   SET status = 'published', published_at = now(), stream_id = x.stream_id
		  FROM unnest($1::uuid[], $2::text[]) AS x(id, stream_id)
		 WHERE o.id = x.id`, ids, streamIDs); err != nil {
		return 0, err
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, err
	}
	m.published.Add(int64(len(ids)))
	return len(ids), nil
}

// timeDrain runs the relay until it has published n rows and returns how
// long that took.
func (m *minimalRelay) timeDrain(ctx context.Context, n int) (time.Duration, error) {
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- m.run(rctx) }()
	for m.published.Load() < int64(n) {
		select {
		case err := <-done:
			return 0, fmt.Errorf("minimal relay stopped after %d of %d rows: %v", m.published.Load(), n, err)
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(2 * time.Millisecond):
		}
	}
	took := time.Since(start)
	cancel()
	if err := <-done; err != nil {
		return 0, err
	}
	return took, nil
}
