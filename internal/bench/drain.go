package bench

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/relay/redisbroker"
)

// Drain measures K relays publishing a backlog of n events (inserted and
// vacuumed before the clock starts). The clock runs from the relays' start
// until they have marked all n published, counted from their own Stats (the
// harness does not poll the table while they work); the table is checked
// afterwards. With published > 0, that many already published rows are
// in the table first (the outbox of a service that has run for a while).
// With baseline (Redis Streams only), the minimal relay (minimalrelay.go)
// then drains the same table, emptied and filled again the same way, for
// ratio_to_baseline. With holdHorizon, a transaction with an xid stays open
// through each drain (a report in REPEATABLE READ, a session idle in
// transaction after a write): PostgreSQL keeps every row version the marks
// leave behind, and their index entries (docs/operations.md, "Backlogs
// behind a long transaction").
func Drain(ctx context.Context, e Env, n, relays, batch, published int, baseline, holdHorizon bool) (Result, error) {
	s, err := e.open(ctx, "drain", int32(2*relays+4))
	if err != nil {
		return Result{}, err
	}
	defer s.close()
	if err := fillBacklog(ctx, s, n, published); err != nil {
		return Result{}, err
	}
	if err := s.warm(ctx, 2*relays); err != nil {
		return Result{}, err
	}
	rs := make([]*relay.Relay, relays)
	for i := range rs {
		rp, err := s.relayPool(ctx)
		if err != nil {
			return Result{}, err
		}
		if rs[i], err = s.newRelay(rp, relay.Config{
			Name: fmt.Sprintf("bench-%d", i), StreamPrefix: s.prefix, BatchSize: batch,
			PollInterval: 50 * time.Millisecond, Logger: e.Log, Partitions: e.partitions(), Ownership: e.Ownership,
			BusyRows: e.BusyRows,
		}, redisbroker.Config{}); err != nil {
			return Result{}, err
		}
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	release, err := s.holdHorizon(ctx, holdHorizon)
	if err != nil {
		return Result{}, err
	}
	rssBefore, rssOK := startRSS()
	start := time.Now()
	for _, r := range rs {
		wg.Go(func() { _ = r.Run(rctx) })
	}
	for {
		var published int64
		for _, r := range rs {
			published += r.Stats().Published
		}
		if published >= int64(n) {
			break
		}
		if err := ctx.Err(); err != nil {
			return Result{}, err
		}
		time.Sleep(2 * time.Millisecond)
	}
	took := time.Since(start)
	release()
	res := Result{Scenario: "drain", N: n, Seconds: took.Seconds(), EventsPerS: float64(n) / took.Seconds(),
		Settings: map[string]any{"relays": relays, "published_rows": published, "batch": batch, "partitions": e.partitions(),
			"broker": s.broker(), "ownership": rs[0].Ownership(), "horizon_held": holdHorizon}}
	stopRSS(&res, rssBefore, rssOK)
	cancel()
	wg.Wait()
	if left, err := s.backlog(ctx); err != nil || left != 0 {
		return Result{}, fmt.Errorf("after the drain %d rows are still unpublished (err %v)", left, err)
	}
	if baseline && s.js == nil {
		// The minimal relay over the same table: emptied and filled the
		// same way, publishing to streams of its own.
		if _, err := s.pool.Exec(ctx, "TRUNCATE outbox_messages"); err != nil {
			return Result{}, err
		}
		if err := fillBacklog(ctx, s, n, published); err != nil {
			return Result{}, err
		}
		rp, err := s.relayPool(ctx)
		if err != nil {
			return Result{}, err
		}
		m := &minimalRelay{pool: rp, rdb: s.rdb, prefix: s.prefix + "minimal.", parts: e.partitions()}
		release, err := s.holdHorizon(ctx, holdHorizon)
		if err != nil {
			return Result{}, err
		}
		took, err := m.timeDrain(ctx, n)
		release()
		if err != nil {
			return Result{}, err
		}
		if left, err := s.backlog(ctx); err != nil || left != 0 {
			return Result{}, fmt.Errorf("after the minimal relay's drain %d rows are still unpublished (err %v)", left, err)
		}
		res.BaselineEventsPerS = ptr(float64(n) / took.Seconds())
		res.RatioToBaseline = ptr(res.EventsPerS / *res.BaselineEventsPerS)
	}
	return res, nil
}

// fillBacklog inserts published already published rows, then a backlog of
// n pending ones, and vacuums the table.
func fillBacklog(ctx context.Context, s *space, n, published int) error {
	var err error
	for done := 0; done < published; done += 1_000_000 {
		_, err = s.pool.Exec(ctx, `INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload,
		                                   status, published_at, stream_id)
			SELECT 'transfer', gen_random_uuid()::text, 'transfer.settled',
			       jsonb_build_object('n', g, 'from_account', 'acct-' || (g % 1000), 'amount_cents', g),
			       'published', now(), '0-1'
			  FROM generate_series(1, $1::int) g`, min(1_000_000, published-done))
		if err != nil {
			return fmt.Errorf("insert the published rows: %w", err)
		}
	}
	// Partition key = sender, as transfer.SettleTx writes it: 1,000 senders.
	_, err = s.pool.Exec(ctx, `INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, partition_key)
		SELECT 'transfer', gen_random_uuid()::text, 'transfer.settled',
		       jsonb_build_object('n', g, 'from_account', 'acct-' || (g % 1000), 'amount_cents', g), 'acct-' || (g % 1000)
		  FROM generate_series(1, $1::int) g`, n)
	if err != nil {
		return fmt.Errorf("insert the backlog: %w", err)
	}
	if _, err := s.pool.Exec(ctx, "VACUUM ANALYZE outbox_messages"); err != nil {
		return err
	}
	return nil
}

// holdHorizon, if hold, opens a transaction that holds the xmin horizon (it
// has an xid) on a connection of its own, until the returned release.
func (s *space) holdHorizon(ctx context.Context, hold bool) (release func(), err error) {
	if !hold {
		return func() {}, nil
	}
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	tx, err := conn.Begin(ctx)
	if err == nil {
		_, err = tx.Exec(ctx, "SELECT txid_current()")
	}
	if err != nil {
		conn.Release()
		return nil, fmt.Errorf("hold the horizon: %w", err)
	}
	return func() {
		_ = tx.Rollback(context.WithoutCancel(ctx))
		conn.Release()
	}, nil
}
