package outbox_test

import (
	"context"
	"github.com/tedbank/outbox/internal/relaytest"
	"io"
	"log/slog"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/queries"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/relay/redisbroker"
)

// Benchmarks of the relay's hot path against the real servers of outboxtest
// (go test -run '^$' -bench RelayBatch .). Each iteration inserts a batch of
// rows (untimed) and runs the relay's own Relay.DrainBatch on it; the timer
// runs only around the step the sub-benchmark names — the claim statement,
// the pipelined XADDs (from the relay's Pipelined call: spans, commands and
// the round trip), the mark statement — or around the whole DrainBatch
// ("batch"). The steps are found by the statement's text (a pgx QueryTracer)
// and by wrapping the relay's Redis client, so what is timed is the relay's
// code, not a copy. They only run with -bench.

const benchBatch = relay.DefaultBatchSize

// stepTimer runs b's timer only around one step of a batch.
type stepTimer struct {
	b    *testing.B
	step string
	sql  map[string]string // statement text → step
}

type stepKey struct{}

func (t *stepTimer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if step := t.sql[data.SQL]; step != "" && step == t.step {
		t.b.StartTimer()
		return context.WithValue(ctx, stepKey{}, step)
	}
	return ctx
}

func (t *stepTimer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	if ctx.Value(stepKey{}) != nil {
		t.b.StopTimer()
	}
}

// timedRedis times the relay's pipelined publish.
type timedRedis struct {
	*redis.Client
	t *stepTimer
}

func (r timedRedis) Pipelined(ctx context.Context, fn func(redis.Pipeliner) error) ([]redis.Cmder, error) {
	if r.t.step == "publish" {
		r.t.b.StartTimer()
		defer r.t.b.StopTimer()
	}
	return r.Client.Pipelined(ctx, fn)
}

func BenchmarkRelayBatch(b *testing.B) {
	for _, step := range []string{"claim", "publish", "mark", "batch"} {
		b.Run(step, func(b *testing.B) { benchRelayStep(b, step) })
	}
}

func benchRelayStep(b *testing.B, step string) {
	ctx := context.Background()
	st := &stepTimer{b: b, step: step, sql: map[string]string{
		queries.Positional(queries.Query("relay_claim")): "claim", queries.Positional(queries.Query("relay_mark_published")): "mark"}}
	cfg, err := pgxpool.ParseConfig(outboxtest.PostgresURL(b))
	if err != nil {
		b.Fatal(err)
	}
	cfg.ConnConfig.Tracer = st
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer pool.Close()
	rdb := outboxtest.NewRedis(b)
	rb, err := redisbroker.New(timedRedis{rdb.Client, st}, redisbroker.Config{})
	if err != nil {
		b.Fatal(err)
	}
	r, err := relay.New(pool, rb, relay.Config{Name: "bench", BatchSize: benchBatch,
		StreamPrefix: rdb.Prefix + "outbox.event.", Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		// One batch of transfer.settled-sized rows, each its own aggregate.
		if _, err := pool.Exec(ctx, `INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, headers)
			SELECT 'transfer', gen_random_uuid()::text, 'transfer.settled',
			       jsonb_build_object('schema_version', 1, 'event_id', gen_random_uuid(), 'transfer_id', gen_random_uuid(),
			                          'from_account', 'acct-' || (g % 1000), 'to_account', 'acct-' || ((g + 1) % 1000),
			                          'amount_cents', g, 'currency', 'BRL', 'settled_at', now()),
			       '{"schema_version":"1"}'
			  FROM generate_series(1, $1::int) g`, benchBatch); err != nil {
			b.Fatal(err)
		}
		if step == "batch" {
			b.StartTimer()
		}
		res, err := relaytest.DrainBatch(ctx, r)
		b.StopTimer()
		if err != nil || res.Published != benchBatch {
			b.Fatalf("batch %+v, err %v", res, err)
		}
	}
	b.ReportMetric(float64(b.N*benchBatch)/b.Elapsed().Seconds(), "events/s")
}
