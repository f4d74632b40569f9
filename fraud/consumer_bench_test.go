package fraud

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/internal/consumertest"
	"github.com/tedbank/outbox/internal/outboxtest"
)

// Benchmarks of the consumer's hot path against the real Redis of
// outboxtest (go test -bench . ./fraud). They only run with -bench.

const benchBatch = DefaultBatchSize // entries per read, as the consumer runs by default

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

func benchEvents(n, accounts int) []Event {
	now := time.Now().UTC()
	evs := make([]Event, n)
	for i := range evs {
		from := rand.IntN(accounts)
		evs[i] = Event{EventID: uuid.New(), TransferID: uuid.New(), FromAccount: fmt.Sprintf("acct-%04d", from),
			ToAccount: fmt.Sprintf("acct-%04d", (from+1)%accounts), AmountCents: 1 + rand.Int64N(1_000_000),
			Currency: "BRL", SettledAt: now}
	}
	return evs
}

// runEffects applies evs as Handle sends them (without ownership): calls of
// effectsPerCall events in one pipeline; it returns their outcomes.
func runEffects(ctx context.Context, b *testing.B, rdb *redis.Client, e *effects, keys Keys, evs []Event) []Outcome {
	now := time.Now()
	var calls []*effectCall
	for i, ev := range evs {
		if i%effectsPerCall == 0 {
			calls = append(calls, e.newEffectCall(keys, "bench", "", now))
		}
		calls[len(calls)-1].add(keys, ev, i, e.cfg.Retention, now)
	}
	cmds := make([]*redis.Cmd, len(calls))
	if _, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, c := range calls {
			cmds[i] = effectScript.EvalSha(ctx, p, c.keys, c.args...)
		}
		return nil
	}); err != nil {
		b.Fatal(err)
	}
	var outs []Outcome
	for i, cmd := range cmds {
		out, err := effectResults(cmd, len(calls[i].msgs))
		if err != nil {
			b.Fatal(err)
		}
		for _, o := range out {
			if o.err != nil {
				b.Fatal(o.err)
			}
			outs = append(outs, o.outcome)
		}
	}
	return outs
}

// BenchmarkEffectScript times one pipelined round trip of the effect script
// for a batch of events, as handle sends it: fresh events ("new", each
// applied) and the same events again ("duplicate", each skipped).
func BenchmarkEffectScript(b *testing.B) {
	for _, dup := range []bool{false, true} {
		name := "new"
		if dup {
			name = "duplicate"
		}
		b.Run(name, func(b *testing.B) {
			rdb := outboxtest.NewRedis(b)
			ctx := context.Background()
			cfg := Config{Config: consumer.Config{Stream: rdb.Prefix + "s", KeyPrefix: rdb.Prefix + "fraud:", Consumer: "bench", Logger: quiet}}.withDefaults()
			e := &effects{cfg: cfg, rdb: rdb.Client, log: quiet}
			keys := Keys{Prefix: cfg.KeyPrefix}
			if err := effectScript.Load(ctx, rdb.Client).Err(); err != nil {
				b.Fatal(err)
			}
			apply := func(evs []Event, wantDup bool) {
				for _, out := range runEffects(ctx, b, rdb.Client, e, keys, evs) {
					if (out == OutcomeDuplicate) != wantDup {
						b.Fatalf("outcome %s", out)
					}
				}
			}
			b.ResetTimer()
			for range b.N {
				b.StopTimer()
				evs := benchEvents(benchBatch, 1000)
				if dup {
					apply(evs, false)
				}
				b.StartTimer()
				apply(evs, dup)
			}
			b.ReportMetric(float64(b.N*benchBatch)/b.Elapsed().Seconds(), "events/s")
		})
	}
}

// BenchmarkConsumerReadNew times one ReadNew of a batch of new entries: the
// XREADGROUP, the pipelined effect scripts and the XACK. The entries are
// added, untimed, before each read.
func BenchmarkConsumerReadNew(b *testing.B) {
	rdb := outboxtest.NewRedis(b)
	ctx := context.Background()
	stream := rdb.Prefix + "outbox.event.transfer"
	c, err := New(rdb.Client, Config{Config: consumer.Config{Stream: stream, KeyPrefix: rdb.Prefix + "fraud:", Consumer: "bench", Block: time.Second, Logger: quiet}})
	if err != nil {
		b.Fatal(err)
	}
	if err := c.EnsureGroup(ctx); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		pipe := rdb.Pipeline()
		for _, ev := range benchEvents(benchBatch, 1000) {
			payload := fmt.Sprintf(`{"schema_version":1,"event_id":%q,"transfer_id":%q,"from_account":%q,"to_account":%q,"amount_cents":%d,"currency":"BRL","settled_at":%q}`,
				ev.EventID, ev.TransferID, ev.FromAccount, ev.ToAccount, ev.AmountCents, ev.SettledAt.Format(time.RFC3339Nano))
			pipe.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{
				"event_id", ev.EventID.String(), "event_type", "transfer.settled", "aggregate_type", "transfer",
				"aggregate_id", ev.TransferID.String(), "payload", payload, "headers", "{}",
				"occurred_at", ev.SettledAt.Format(time.RFC3339Nano), "seq", 1}})
		}
		if _, err := pipe.Exec(ctx); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		n, err := consumertest.ReadNew(ctx, c.Consumer)
		if err != nil || n != benchBatch {
			b.Fatalf("read %d entries, err %v", n, err)
		}
	}
	b.StopTimer()
	if st := c.Stats(); st.Processed != int64(b.N*benchBatch) {
		b.Fatalf("processed %d, want %d", st.Processed, b.N*benchBatch)
	}
	b.ReportMetric(float64(b.N*benchBatch)/b.Elapsed().Seconds(), "events/s")
}

// BenchmarkEffectScriptWindow times the effect script of an event whose
// sender already has k transfers in the window (settled in order, one a
// millisecond apart, as a busy account's): the velocity rule's total must
// not cost O(k).
func BenchmarkEffectScriptWindow(b *testing.B) {
	for _, k := range []int{10, 1000} {
		b.Run(fmt.Sprintf("k=%d", k), func(b *testing.B) {
			rdb := outboxtest.NewRedis(b)
			ctx := context.Background()
			cfg := Config{Config: consumer.Config{Stream: rdb.Prefix + "s", KeyPrefix: rdb.Prefix + "fraud:", Consumer: "bench", Logger: quiet}, AmountLimitCents: 1 << 40, WindowLimitCents: 1 << 50}.withDefaults()
			e := &effects{cfg: cfg, rdb: rdb.Client, log: quiet}
			keys := Keys{Prefix: cfg.KeyPrefix}
			if err := effectScript.Load(ctx, rdb.Client).Err(); err != nil {
				b.Fatal(err)
			}
			const senders = benchBatch // one event of each sender per pipeline
			at := time.Now().UTC().Add(-time.Minute)
			batch := func() {
				evs := benchEvents(senders, senders)
				for i := range evs {
					evs[i].FromAccount = fmt.Sprintf("acct-%04d", i)
					evs[i].SettledAt = at
				}
				at = at.Add(time.Millisecond)
				for _, out := range runEffects(ctx, b, rdb.Client, e, keys, evs) {
					if out != OutcomeApprove {
						b.Fatalf("outcome %s", out)
					}
				}
			}
			for range k {
				batch()
			}
			b.ResetTimer()
			for range b.N {
				batch()
			}
			b.ReportMetric(float64(b.N*senders)/b.Elapsed().Seconds(), "events/s")
		})
	}
}
