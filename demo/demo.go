// Package demo walks through the outbox end to end against real servers:
// TEDs settled and judged by anti-fraud within milliseconds, a duplicate
// delivery skipped, and a relay that died after claiming whose rows are
// reaped and published by another. Every scenario checks its own outcome.
package demo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/transfer"
)

// Config says where the demo runs.
type Config struct {
	Pool         *pgxpool.Pool
	Redis        *redis.Client
	StreamPrefix string // relay stream prefix; the transfer stream is <prefix>transfer
	KeyPrefix    string // anti-fraud key prefix
	Out          io.Writer
	Logger       *slog.Logger // logs of the relay and consumer (quiet by default)
}

// ErrChecksFailed is returned when any scenario's check failed.
var ErrChecksFailed = errors.New("demo checks failed")

type runner struct {
	Config
	passed, failed int
	rdb            *redis.Client
}

// Run runs every scenario and prints a closing summary line.
func Run(ctx context.Context, cfg Config) error {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	r := &runner{Config: cfg, rdb: cfg.Redis}
	start := time.Now()

	consCtx, stopCons := context.WithCancel(ctx)
	cons, err := fraud.New(r.rdb, fraud.Config{
		Stream: cfg.StreamPrefix + transfer.AggregateType, KeyPrefix: cfg.KeyPrefix,
		Consumer: "demo-fraud", Block: 200 * time.Millisecond, Logger: cfg.Logger,
	})
	if err != nil {
		stopCons()
		return err
	}
	if err := cons.EnsureGroup(ctx); err != nil {
		stopCons()
		return err
	}
	var wg sync.WaitGroup
	wg.Go(func() { _ = cons.Run(consCtx) })
	defer func() { stopCons(); wg.Wait() }()

	steps := []struct {
		title string
		run   func(context.Context) error
	}{
		{"1. TEDs settled one by one: commit -> published -> anti-fraud verdict", r.settleOneByOne},
		{"2. The same event delivered twice: anti-fraud applies it once", r.duplicate},
		{"3. A relay dies right after claiming: the reaper returns its rows after the lease", r.deadRelay},
	}
	for _, s := range steps {
		fmt.Fprintf(r.Out, "\n%s\n", s.title)
		if err := s.run(ctx); err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			r.check(false, "scenario ran: %v", err)
		}
	}
	fmt.Fprintf(r.Out, "\ndemo: %d checks passed, %d failed (%.1fs)\n", r.passed, r.failed, time.Since(start).Seconds())
	if r.failed > 0 {
		return ErrChecksFailed
	}
	return nil
}

func (r *runner) check(ok bool, format string, args ...any) {
	mark := "ok  "
	if ok {
		r.passed++
	} else {
		r.failed++
		mark = "FAIL"
	}
	fmt.Fprintf(r.Out, "   [%s] %s\n", mark, fmt.Sprintf(format, args...))
}

func (r *runner) newRelay(name string, lease time.Duration) (*relay.Relay, error) {
	return relay.New(r.Pool, r.rdb, relay.Config{
		Name: name, StreamPrefix: r.StreamPrefix, Lease: lease, ReapInterval: lease / 4,
		PollInterval: 5 * time.Second, Logger: r.Logger,
	})
}

// runRelay starts a relay and returns a function that stops it.
func (r *runner) runRelay(ctx context.Context, rl *relay.Relay) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = rl.Run(ctx) }()
	return func() { cancel(); <-done }
}

// waitVerdict polls until transferID has a verdict or the timeout passes.
func (r *runner) waitVerdict(ctx context.Context, transferID uuid.UUID, timeout time.Duration) (string, time.Duration, error) {
	start := time.Now()
	for time.Since(start) < timeout {
		v, err := fraud.Verdict(ctx, r.rdb, r.KeyPrefix, transferID.String())
		if err != nil {
			return "", 0, err
		}
		if v != "" {
			return v, time.Since(start), nil
		}
		time.Sleep(200 * time.Microsecond)
	}
	return "", timeout, nil
}

func (r *runner) settleOneByOne(ctx context.Context) error {
	rl, err := r.newRelay("demo-relay-1", 30*time.Second)
	if err != nil {
		return err
	}
	stop := r.runRelay(ctx, rl)
	defer stop()
	// Give the relay a moment to LISTEN; the fallback poll would catch up anyway.
	time.Sleep(100 * time.Millisecond)

	teds := []transfer.Transfer{
		{FromAccount: "ana-0001", ToAccount: "bruno-0002", AmountCents: 125_000},
		{FromAccount: "carla-0003", ToAccount: "davi-0004", AmountCents: 4_990_00},
		{FromAccount: "ana-0001", ToAccount: "edu-0005", AmountCents: 75_000_00}, // above the R$ 50.000 rule
		{FromAccount: "fabi-0006", ToAccount: "ana-0001", AmountCents: 32_10},
	}
	want := []string{"approve", "approve", "review", "approve"}
	for i, t := range teds {
		t.ID = uuid.New()
		t0 := time.Now()
		res, err := transfer.Settle(ctx, r.Pool, t)
		if err != nil {
			return err
		}
		commit := time.Since(t0)
		verdict, took, err := r.waitVerdict(ctx, t.ID, 10*time.Second)
		if err != nil {
			return err
		}
		// The verdict can arrive before the relay's mark commits; wait for it.
		publishedMs := -1.0
		for range 100 {
			err := r.Pool.QueryRow(ctx, `SELECT coalesce(extract(epoch FROM published_at - created_at) * 1000, -1)
				FROM outbox_messages WHERE id = $1`, res.EventID).Scan(&publishedMs)
			if err != nil || publishedMs >= 0 {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		fmt.Fprintf(r.Out, "   TED %-10s -> %-10s R$ %9s  commit %5.2f ms | marked published %5.2f ms after insert | verdict %-7s %5.2f ms after commit\n",
			t.FromAccount, t.ToAccount, transfer.FormatBRL(t.AmountCents), ms(commit), publishedMs, verdict, ms(took))
		r.check(verdict == want[i], "TED %d judged %q (want %q)", i+1, verdict, want[i])
	}
	again, err := transfer.Settle(ctx, r.Pool, transfer.Transfer{ID: uuid.New(), FromAccount: "x", ToAccount: "x", AmountCents: 1})
	r.check(errors.Is(err, transfer.ErrInvalid) && again.EventID == uuid.Nil,
		"a TED to the same account is refused and writes nothing: %v", err)
	return nil
}

func (r *runner) duplicate(ctx context.Context) error {
	stream := r.StreamPrefix + transfer.AggregateType
	entries, err := r.rdb.XRevRangeN(ctx, stream, "+", "-", 1).Result()
	if err != nil || len(entries) == 0 {
		return fmt.Errorf("read last stream entry: %v", err)
	}
	before, err := fraud.ReadReport(ctx, r.rdb, r.KeyPrefix)
	if err != nil {
		return err
	}
	values := make([]any, 0, 2*len(entries[0].Values))
	for k, v := range entries[0].Values {
		values = append(values, k, v)
	}
	if err := r.rdb.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: values}).Err(); err != nil {
		return err
	}
	fmt.Fprintf(r.Out, "   re-published event %v (as a relay does after a crash between XADD and its mark)\n", entries[0].Values["event_id"])
	var after fraud.Report
	for range 200 {
		if after, err = fraud.ReadReport(ctx, r.rdb, r.KeyPrefix); err != nil {
			return err
		}
		if after.DuplicatesSkipped > before.DuplicatesSkipped {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	r.check(after.DuplicatesSkipped == before.DuplicatesSkipped+1, "anti-fraud recognised the duplicate (duplicates skipped %d -> %d)",
		before.DuplicatesSkipped, after.DuplicatesSkipped)
	r.check(after.Verdicts == before.Verdicts, "no second effect (verdicts stay %d)", after.Verdicts)
	return nil
}

func (r *runner) deadRelay(ctx context.Context) error {
	// Settle three TEDs with no relay running, then claim them as a relay
	// that dies right after its claim would leave them.
	var ids []uuid.UUID
	for i := range 3 {
		t := transfer.Transfer{ID: uuid.New(), FromAccount: fmt.Sprintf("gabi-%04d", i), ToAccount: "hugo-0009", AmountCents: int64(1000 * (i + 1))}
		if _, err := transfer.Settle(ctx, r.Pool, t); err != nil {
			return err
		}
		ids = append(ids, t.ID)
	}
	tag, err := r.Pool.Exec(ctx, `UPDATE outbox_messages SET status = 'publishing', claimed_at = now(),
		claimed_by = 'demo-relay-that-died', claim_token = gen_random_uuid()
		WHERE aggregate_id = ANY($1) AND status = 'pending'`, uuidStrings(ids))
	if err != nil {
		return err
	}
	fmt.Fprintf(r.Out, "   a relay claimed %d rows and died: they stay 'publishing'\n", tag.RowsAffected())
	r.check(tag.RowsAffected() == 3, "3 rows left in publishing by the dead relay")

	lease := 1500 * time.Millisecond
	rl, err := r.newRelay("demo-relay-2", lease)
	if err != nil {
		return err
	}
	t0 := time.Now()
	stop := r.runRelay(ctx, rl)
	defer stop()
	fmt.Fprintf(r.Out, "   another relay starts (lease %s); waiting for the reaper...\n", lease)
	var verdicts int
	for _, id := range ids {
		v, _, err := r.waitVerdict(ctx, id, 15*time.Second)
		if err != nil {
			return err
		}
		if v != "" {
			verdicts++
		}
	}
	var published int
	if err := r.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_messages WHERE aggregate_id = ANY($1) AND status = 'published'`,
		uuidStrings(ids)).Scan(&published); err != nil {
		return err
	}
	fmt.Fprintf(r.Out, "   reaped %d claims, published and judged after %.1fs\n", rl.Stats().Reaped, time.Since(t0).Seconds())
	r.check(published == 3 && verdicts == 3, "all 3 published by the second relay and judged once (%d published, %d verdicts)", published, verdicts)
	return nil
}

func uuidStrings(ids []uuid.UUID) []string {
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = id.String()
	}
	return out
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
