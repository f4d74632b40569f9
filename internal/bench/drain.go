package bench

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/tedbank/outbox/relay"
)

// Drain measures K relays publishing a backlog of n events (inserted and
// vacuumed before the clock starts). The clock runs from the relays' start
// until they have marked all n published, counted from their own Stats (the
// harness does not poll the table while they work); the table is checked
// afterwards. With published > 0, that many already published rows are
// in the table first (the outbox of a service that has run for a while).
func Drain(ctx context.Context, e Env, n, relays, batch, published int) (Result, error) {
	s, err := e.open(ctx, "drain", int32(2*relays+4))
	if err != nil {
		return Result{}, err
	}
	defer s.close()
	for done := 0; done < published; done += 1_000_000 {
		_, err = s.pool.Exec(ctx, `INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload,
		                                   status, published_at, stream_id)
			SELECT 'transfer', gen_random_uuid()::text, 'transfer.settled',
			       jsonb_build_object('n', g, 'from_account', 'acct-' || (g % 1000), 'amount_cents', g),
			       'published', now(), '0-1'
			  FROM generate_series(1, $1::int) g`, min(1_000_000, published-done))
		if err != nil {
			return Result{}, fmt.Errorf("insert the published rows: %w", err)
		}
	}
	// Partition key = sender, as transfer.SettleTx writes it: 1,000 senders.
	_, err = s.pool.Exec(ctx, `INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, partition_key)
		SELECT 'transfer', gen_random_uuid()::text, 'transfer.settled',
		       jsonb_build_object('n', g, 'from_account', 'acct-' || (g % 1000), 'amount_cents', g), 'acct-' || (g % 1000)
		  FROM generate_series(1, $1::int) g`, n)
	if err != nil {
		return Result{}, fmt.Errorf("insert the backlog: %w", err)
	}
	if _, err := s.pool.Exec(ctx, "VACUUM ANALYZE outbox_messages"); err != nil {
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
		}); err != nil {
			return Result{}, err
		}
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
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
	res := Result{Scenario: "drain", N: n, Seconds: took.Seconds(), EventsPerS: float64(n) / took.Seconds(),
		Settings: map[string]any{"relays": relays, "published_rows": published, "batch": batch, "partitions": e.partitions(),
			"broker": s.broker()}}
	stopRSS(&res, rssBefore, rssOK)
	cancel()
	wg.Wait()
	if left, err := s.backlog(ctx); err != nil || left != 0 {
		return Result{}, fmt.Errorf("after the drain %d rows are still unpublished (err %v)", left, err)
	}
	return res, nil
}
