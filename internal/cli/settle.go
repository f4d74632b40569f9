package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/internal/connect"
	"github.com/tedbank/outbox/internal/queries"
	"github.com/tedbank/outbox/internal/traceexport"
	"github.com/tedbank/outbox/transfer"
)

// SettleSummary is what 'outbox settle --json' prints.
type SettleSummary struct {
	Settled     int64   `json:"settled"`
	Failed      int64   `json:"failed"`
	AmountCents int64   `json:"amount_cents"`
	Seconds     float64 `json:"seconds"`
	PerSecond   float64 `json:"per_second"`
	P50Ms       float64 `json:"p50_ms"`
	P99Ms       float64 `json:"p99_ms"`
	MaxMs       float64 `json:"max_ms"`
	Concurrency int     `json:"concurrency"`
	Accounts    int     `json:"accounts"`
	Rate        float64 `json:"rate"`
	LastError   string  `json:"last_error,omitempty"`
}

func runSettle(ctx context.Context, e *env, args []string) error {
	var c common
	fs := e.flags("settle", &c)
	count := fs.Int("count", 0, "TEDs to settle (required)")
	concurrency := fs.Int("concurrency", 4, "concurrent writers")
	accounts := fs.Int("accounts", 100, "number of accounts the TEDs are drawn between (at least 2)")
	rate := fs.Float64("rate", 0, "at most this many TEDs per second (0 = as fast as possible)")
	maxAmount := fs.Int64("max-amount", 1_000_000, "largest amount in cents (amounts are uniform in 1..max)")
	asJSON := fs.Bool("json", false, "print the summary as JSON")
	plainSQL := fs.Float64("plain-sql", 0, "this share of the TEDs (0 to 1) is written with plain SQL, as a service without this project's packages would: no partition_key, no writer lock (migration 0015 keys and orders them)")
	if err := e.parse(fs, args); err != nil {
		return err
	}
	switch {
	case !isSet(fs, "count"):
		return usagef("--count is required: how many TEDs to settle (e.g. --count 100)")
	case *count <= 0:
		return usagef("--count %d: must be positive", *count)
	case *concurrency <= 0 || *concurrency > 1000:
		return usagef("--concurrency must be between 1 and 1000")
	case *accounts < 2:
		return usagef("--accounts must be at least 2")
	case *rate < 0:
		return usagef("--rate must not be negative")
	case *maxAmount <= 0:
		return usagef("--max-amount must be positive")
	case *plainSQL < 0 || *plainSQL > 1:
		return usagef("--plain-sql %g: a share from 0 to 1", *plainSQL)
	}
	log, err := c.logger(e.stderr)
	if err != nil {
		return err
	}
	stopTracing, err := traceexport.Setup(ctx, "outbox-settle", log)
	if err != nil {
		return err
	}
	defer stopTracing(context.WithoutCancel(ctx))
	pool, err := openOutbox(ctx, c.databaseURL, connect.PostgresOptions{AppName: "outbox-settle", MaxConns: int32(*concurrency)})
	if err != nil {
		return err
	}
	defer pool.Close()

	jobs := make(chan transfer.Transfer)
	go func() {
		defer close(jobs)
		var tick <-chan time.Time
		if *rate > 0 {
			t := time.NewTicker(time.Duration(float64(time.Second) / *rate))
			defer t.Stop()
			tick = t.C
		}
		for range *count {
			if tick != nil {
				select {
				case <-ctx.Done():
					return
				case <-tick:
				}
			}
			from := rand.IntN(*accounts)
			to := (from + 1 + rand.IntN(*accounts-1)) % *accounts
			t := transfer.Transfer{
				ID:          uuid.New(),
				FromAccount: fmt.Sprintf("acct-%04d", from),
				ToAccount:   fmt.Sprintf("acct-%04d", to),
				AmountCents: 1 + rand.Int64N(*maxAmount),
			}
			select {
			case <-ctx.Done():
				return
			case jobs <- t:
			}
		}
	}()

	var (
		settled, failed, amount atomic.Int64
		mu                      sync.Mutex
		lat                     []time.Duration
		lastErr                 string
		wg                      sync.WaitGroup
	)
	start := time.Now()
	stopProgress := func() {}
	if isTerminal(e.stderr) {
		// A long run on a terminal shows where it is, on stderr only
		// (stdout stays the summary, plain or --json).
		stopProgress = startProgress(e.stderr, time.Second, func() string {
			return progressLine(settled.Load()+failed.Load(), int64(*count), time.Since(start))
		})
	}
	defer stopProgress()
	for range *concurrency {
		wg.Go(func() {
			var mine []time.Duration
			for t := range jobs {
				t0 := time.Now()
				var err error
				if *plainSQL > 0 && rand.Float64() < *plainSQL {
					err = settlePlain(ctx, pool, t)
				} else {
					_, err = transfer.Settle(ctx, pool, t)
				}
				if err != nil {
					failed.Add(1)
					mu.Lock()
					lastErr = oneLine(err)
					mu.Unlock()
					continue
				}
				mine = append(mine, time.Since(t0))
				settled.Add(1)
				amount.Add(t.AmountCents)
			}
			mu.Lock()
			lat = append(lat, mine...)
			mu.Unlock()
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	// The progress line is cleared before the summary is printed: on a
	// terminal both land on one screen, and the summary went after the
	// last progress line, on the same line.
	stopProgress()

	slices.Sort(lat)
	sum := SettleSummary{
		Settled: settled.Load(), Failed: failed.Load(), AmountCents: amount.Load(),
		Seconds: elapsed.Seconds(), PerSecond: float64(settled.Load()) / elapsed.Seconds(),
		P50Ms: ms(percentile(lat, 0.50)), P99Ms: ms(percentile(lat, 0.99)), MaxMs: ms(percentile(lat, 1)),
		Concurrency: *concurrency, Accounts: *accounts, Rate: *rate, LastError: lastErr,
	}
	if *asJSON {
		if err := json.NewEncoder(e.stdout).Encode(sum); err != nil {
			return err
		}
	} else {
		fmt.Fprintf(e.stdout, "settled %d TEDs (R$ %s) in %.2fs: %.0f/s, commit latency p50 %.2f ms p99 %.2f ms; failed %d\n",
			sum.Settled, transfer.FormatBRL(sum.AmountCents), sum.Seconds, sum.PerSecond, sum.P50Ms, sum.P99Ms, sum.Failed)
	}
	switch {
	case ctx.Err() != nil:
		return fmt.Errorf("interrupted after %d of %d TEDs", sum.Settled, *count)
	case sum.Failed > 0:
		return fmt.Errorf("%d of %d TEDs failed; last error: %s", sum.Failed, *count, lastErr)
	}
	return nil
}

// percentile returns the p-quantile of sorted (nearest rank).
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(p*float64(len(sorted))+0.5) - 1
	return sorted[max(0, min(i, len(sorted)-1))]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// progressLine says how far a run of total items is after elapsed.
func progressLine(done, total int64, elapsed time.Duration) string {
	rate := float64(done) / max(elapsed.Seconds(), 1e-9)
	line := fmt.Sprintf("%d/%d TEDs (%.0f%%), %.0f/s", done, total, 100*float64(done)/float64(max(total, 1)), rate)
	if rate > 0 && done < total {
		eta := time.Duration(float64(total-done) / rate * float64(time.Second)).Round(time.Second)
		line += ", ETA " + eta.String()
	}
	return line
}

// settlePlain settles t with plain SQL (queries/settle_plain.sql), as a
// writer without this project's packages would.
func settlePlain(ctx context.Context, pool *pgxpool.Pool, t transfer.Transfer) error {
	eventID, err := uuid.NewV7()
	if err != nil {
		return err
	}
	q := queries.SettlePlain(t.ID, t.FromAccount, t.ToAccount, t.AmountCents, eventID)
	if _, err := pool.Exec(ctx, q.SQL, q.Args...); err != nil {
		return fmt.Errorf("settle %s with plain SQL: %w", t.ID, err)
	}
	return nil
}

// startProgress writes line() to w every interval, each over the last
// (a carriage return and an erase to the end of the line), until the
// returned function is called: it erases the line and returns once
// nothing more is written. Calling it again does nothing.
func startProgress(w io.Writer, every time.Duration, line func() string) (stop func()) {
	quit, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-quit:
				fmt.Fprint(w, "\r\033[K")
				return
			case <-t.C:
				fmt.Fprint(w, "\r\033[K"+line())
			}
		}
	}()
	var once sync.Once
	return func() {
		once.Do(func() {
			close(quit)
			<-done
		})
	}
}
