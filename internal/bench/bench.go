// Package bench measures the outbox end to end on real servers, each
// scenario in a database of its own (created and dropped) and under a Redis
// key prefix of its own (deleted afterwards):
//
//   - drain: how fast K relays publish a backlog of N events;
//   - latency: commit → stream entry (seen by a separate XREAD reader) and
//     commit → anti-fraud verdict, settling at a steady rate.
package bench

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/migrate"
	"github.com/tedbank/outbox/internal/testenv"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/transfer"
)

// Result is one measurement; --json prints it as one line.
type Result struct {
	Scenario   string         `json:"scenario"`
	N          int            `json:"n"`
	Seconds    float64        `json:"seconds"`
	EventsPerS float64        `json:"events_per_s"`
	P50Ms      float64        `json:"p50_ms"`
	P90Ms      float64        `json:"p90_ms"`
	P99Ms      float64        `json:"p99_ms"`
	MaxMs      float64        `json:"max_ms"`
	Settings   map[string]any `json:"settings"`
}

// Env is where a scenario runs.
type Env struct {
	AdminURL string // a PostgreSQL URL allowed to create databases
	Redis    *redis.Client
	Log      *slog.Logger
}

// space is one scenario's database and key prefix.
type space struct {
	pool   *pgxpool.Pool
	prefix string
	drop   func(context.Context) error
	rdb    *redis.Client
}

func (e Env) open(ctx context.Context, name string) (*space, error) {
	dbURL, drop, err := testenv.CreateDatabase(ctx, e.AdminURL, "bench_"+name)
	if err != nil {
		return nil, fmt.Errorf("create the benchmark database (the URL's user needs CREATEDB): %w", err)
	}
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		_ = drop(ctx)
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = "outbox-bench"
	cfg.MaxConns = 64
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		_ = drop(ctx)
		return nil, err
	}
	if _, err := migrate.Up(ctx, pool); err != nil {
		pool.Close()
		_ = drop(ctx)
		return nil, err
	}
	return &space{pool: pool, drop: drop, rdb: e.Redis, prefix: "bench-" + uuid.NewString()[:8] + ":"}, nil
}

func (s *space) close() {
	s.pool.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_ = s.drop(ctx)
	iter := s.rdb.Scan(ctx, 0, s.prefix+"*", 1000).Iterator()
	for iter.Next(ctx) {
		s.rdb.Del(ctx, iter.Val())
	}
}

// Drain measures K relays publishing a backlog of n events.
func Drain(ctx context.Context, e Env, n, relays, batch int) (Result, error) {
	s, err := e.open(ctx, "drain")
	if err != nil {
		return Result{}, err
	}
	defer s.close()
	_, err = s.pool.Exec(ctx, `INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload)
		SELECT 'transfer', gen_random_uuid()::text, 'transfer.settled',
		       jsonb_build_object('n', g, 'from_account', 'acct-' || (g % 1000), 'amount_cents', g)
		  FROM generate_series(1, $1::int) g`, n)
	if err != nil {
		return Result{}, fmt.Errorf("insert the backlog: %w", err)
	}
	if _, err := s.pool.Exec(ctx, "VACUUM ANALYZE outbox_messages"); err != nil {
		return Result{}, err
	}
	rctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	start := time.Now()
	for i := range relays {
		r, err := relay.New(s.pool, s.rdb, relay.Config{
			Name: fmt.Sprintf("bench-%d", i), StreamPrefix: s.prefix, BatchSize: batch,
			PollInterval: 50 * time.Millisecond, Logger: e.Log,
		})
		if err != nil {
			cancel()
			return Result{}, err
		}
		wg.Go(func() { _ = r.Run(rctx) })
	}
	for {
		var left int
		if err := s.pool.QueryRow(ctx, "SELECT count(*) FROM outbox_messages WHERE status <> 'published'").Scan(&left); err != nil {
			cancel()
			wg.Wait()
			return Result{}, err
		}
		if left == 0 || ctx.Err() != nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	took := time.Since(start)
	cancel()
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return Result{}, err
	}
	return Result{Scenario: "drain", N: n, Seconds: took.Seconds(), EventsPerS: float64(n) / took.Seconds(),
		Settings: map[string]any{"relays": relays, "batch": batch}}, nil
}

// Latency settles n TEDs at rate per second with one relay and one
// consumer, and measures commit → stream entry (a separate XREAD reader) and
// commit → verdict. It returns both results.
func Latency(ctx context.Context, e Env, rate float64, n int) ([]Result, error) {
	s, err := e.open(ctx, "latency")
	if err != nil {
		return nil, err
	}
	defer s.close()
	stream := s.prefix + transfer.AggregateType
	var (
		mu                  sync.Mutex
		committed           = make(map[string]time.Time, n)
		inStream, judged    = make(map[string]time.Time, n), make(map[string]time.Time, n)
		toStream, toVerdict []time.Duration
	)
	bg, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()

	// The reader: blocking XREAD from the start, matching event ids.
	wg.Go(func() {
		last := "0"
		for bg.Err() == nil {
			res, err := s.rdb.XRead(bg, &redis.XReadArgs{Streams: []string{stream, last}, Count: 1000, Block: 200 * time.Millisecond}).Result()
			if err != nil {
				continue
			}
			now := time.Now()
			mu.Lock()
			for _, m := range res[0].Messages {
				last = m.ID
				if id, _ := m.Values["event_id"].(string); id != "" {
					if _, seen := inStream[id]; !seen {
						inStream[id] = now
					}
				}
			}
			mu.Unlock()
		}
	})
	r, err := relay.New(s.pool, s.rdb, relay.Config{Name: "bench", StreamPrefix: s.prefix, Logger: e.Log})
	if err != nil {
		return nil, err
	}
	wg.Go(func() { _ = r.Run(bg) })
	c, err := fraud.New(s.rdb, fraud.Config{Stream: stream, KeyPrefix: s.prefix + "fraud:", Consumer: "bench",
		Block: 200 * time.Millisecond, Logger: e.Log,
		OnProcessed: func(ev fraud.Event, outcome string) {
			now := time.Now()
			mu.Lock()
			if _, seen := judged[ev.EventID.String()]; !seen {
				judged[ev.EventID.String()] = now
			}
			mu.Unlock()
		}})
	if err != nil {
		return nil, err
	}
	wg.Go(func() { _ = c.Run(bg) })
	for !r.Stats().ListenUp && bg.Err() == nil {
		time.Sleep(time.Millisecond)
	}

	tick := time.NewTicker(time.Duration(float64(time.Second) / rate))
	defer tick.Stop()
	start := time.Now()
	var writers sync.WaitGroup
	for i := range n {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-tick.C:
		}
		writers.Go(func() {
			t := transfer.Transfer{ID: uuid.New(), FromAccount: fmt.Sprintf("acct-%03d", i%500), ToAccount: "dest", AmountCents: int64(100 + i)}
			res, err := transfer.Settle(bg, s.pool, t)
			if err != nil {
				return
			}
			now := time.Now()
			mu.Lock()
			committed[res.EventID.String()] = now
			mu.Unlock()
		})
	}
	writers.Wait()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		mu.Lock()
		done := len(judged) >= len(committed) && len(inStream) >= len(committed)
		mu.Unlock()
		if done {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	took := time.Since(start)
	mu.Lock()
	for id, at := range committed {
		if t, ok := inStream[id]; ok {
			toStream = append(toStream, t.Sub(at))
		}
		if t, ok := judged[id]; ok {
			toVerdict = append(toVerdict, t.Sub(at))
		}
	}
	settled := len(committed)
	mu.Unlock()
	if len(toStream) < settled || len(toVerdict) < settled {
		return nil, fmt.Errorf("only %d of %d events reached the stream and %d anti-fraud within 30s", len(toStream), settled, len(toVerdict))
	}
	settings := map[string]any{"rate": rate, "relays": 1, "consumers": 1}
	return []Result{
		percentiles("latency_commit_to_stream", toStream, took, settings),
		percentiles("latency_commit_to_verdict", toVerdict, took, settings),
	}, nil
}

func percentiles(scenario string, xs []time.Duration, took time.Duration, settings map[string]any) Result {
	slices.Sort(xs)
	q := func(p float64) float64 {
		if len(xs) == 0 {
			return 0
		}
		return float64(xs[min(len(xs)-1, int(p*float64(len(xs))))].Microseconds()) / 1000
	}
	return Result{Scenario: scenario, N: len(xs), Seconds: took.Seconds(), EventsPerS: float64(len(xs)) / took.Seconds(),
		P50Ms: q(0.5), P90Ms: q(0.9), P99Ms: q(0.99), MaxMs: q(1), Settings: settings}
}
