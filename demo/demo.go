// Package demo walks through the outbox end to end against real servers, the
// way `make demo` shows it:
//
//  1. TEDs settled one by one, each with its timeline (settled, notified,
//     claimed, published, judged by anti-fraud, in the order they happened);
//     one trips the velocity rule.
//  2. A relay killed right after claiming (a real process, SIGKILLed at a
//     fail point): the reaper returns its rows after the lease and another
//     relay publishes them; anti-fraud applies each once.
//  3. The same event delivered twice: anti-fraud recognises and skips it.
//  4. Redis unavailable: settlements keep committing, the outbox grows, and it
//     drains when Redis returns.
//  5. A burst of TEDs with a progress bar, ending with throughput and latency
//     percentiles.
//  6. The ledger, a consumer that keeps its state in its own PostgreSQL
//     (package ledger, on consumer/inbox), reads the whole demo, is SIGKILLed
//     after a commit and before its XACK, and restarts: every TED is posted
//     exactly once and the balances equal the transfers.
//
// Every scenario checks its own outcome; Run fails if any check failed.
package demo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/tcpproxy"
	"github.com/tedbank/outbox/transfer"
)

// Config says where the demo runs and how it prints.
type Config struct {
	Pool        *pgxpool.Pool
	Redis       redis.UniversalClient // the demo's own client (reports, checks)
	DatabaseURL string                // for the relay process of scenario 2
	RedisURL    string                // idem; also what the proxies of scenario 4 front
	// Cluster: Redis is a Redis Cluster (Redis a *redis.ClusterClient,
	// RedisURL in the cluster URL form); the demo fronts every node with a
	// proxy of its own.
	Cluster bool
	// Partitions is the relays' and the consumer's (0: 1; a cluster needs
	// at least 2, anti-fraud's rule).
	Partitions int
	// Binary is the outbox command, run (and killed) in scenario 2.
	// Default: this executable.
	Binary string
	// FailPoints: Binary was built with -tags failpoint. Scenario 2 crashes
	// its relay at a fail point; without them it is reported as not run.
	FailPoints   bool
	StreamPrefix string // relay stream prefix; the transfer stream is <prefix>transfer
	KeyPrefix    string // anti-fraud key prefix
	// LedgerURL is a database of the ledger's own for scenario 6 (empty:
	// not run); LedgerKeyPrefix its consumer's Redis key prefix.
	LedgerURL       string
	LedgerKeyPrefix string
	Out             io.Writer
	Color           bool         // ANSI colours and a redrawn progress bar (a terminal)
	Short           bool         // a smaller burst, for CI
	Logger          *slog.Logger // logs of the relays and the consumer; quiet by default
}

// ErrChecksFailed is returned when any scenario's check failed.
var ErrChecksFailed = errors.New("demo checks failed")

// Run runs every scenario and prints a closing summary line.
func Run(ctx context.Context, cfg Config) error {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Binary == "" {
		exe, err := os.Executable()
		if err != nil {
			return fmt.Errorf("find the outbox binary: %w", err)
		}
		cfg.Binary = exe
	}
	d := &demo{Config: cfg, tl: newTimelines()}
	start := time.Now()
	if err := d.setUp(ctx); err != nil {
		d.tearDown()
		return err
	}
	defer d.tearDown()

	scenarios := []struct {
		title string
		run   func(context.Context) error
	}{
		{"TEDs settled one by one: commit → NOTIFY → claim → XADD → anti-fraud verdict", d.oneByOne},
		{"A relay dies right after claiming; the reaper hands its rows to another relay", d.deadRelay},
		{"The same event delivered twice is applied once", d.duplicate},
		{"Redis unavailable: settlements keep committing, the outbox drains afterwards", d.redisDown},
		{"A burst of TEDs", d.burst},
		{"A ledger in its own database: its consumer dies after a commit, and every TED is still posted once", d.ledgerCrash},
	}
	for i, s := range scenarios {
		fmt.Fprintf(d.Out, "\n%s\n", d.bold(fmt.Sprintf("%d. %s", i+1, s.title)))
		if err := s.run(ctx); err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			d.check(false, "scenario ran to the end: %v", err)
		}
	}
	summary := fmt.Sprintf("demo: %d checks passed, %d failed (%.1fs)", d.passed, d.failed, time.Since(start).Seconds())
	if d.notRun > 0 {
		summary += fmt.Sprintf("; %d scenario(s) not run (make demo runs them all: it builds with -tags failpoint and has a database for the ledger)", d.notRun)
	}
	if d.failed > 0 {
		fmt.Fprintf(d.Out, "\n%s\n", d.paint(summary, red))
		return ErrChecksFailed
	}
	fmt.Fprintf(d.Out, "\n%s\n", d.paint(summary, green))
	return nil
}

type demo struct {
	Config
	passed, failed int
	notRun         int // scenarios this binary cannot run

	tl       *timelines
	proxies  []*tcpproxy.Proxy // every relay and consumer reaches Redis through them
	viaProxy redis.UniversalClient
	listen   *pgx.Conn // the demo's own LISTEN, to timestamp notifications
	started  time.Time // the database's clock when the demo began
	stopBg   func()
	relay    *runningRelay
}

func (d *demo) check(ok bool, format string, args ...any) {
	mark := d.paint("✓", green)
	if ok {
		d.passed++
	} else {
		d.failed++
		mark = d.paint("✗ FAILED:", red)
	}
	fmt.Fprintf(d.Out, "   %s %s\n", mark, fmt.Sprintf(format, args...))
}

func (d *demo) settle(ctx context.Context, t transfer.Transfer) (transfer.Result, error) {
	start := time.Now()
	res, err := transfer.Settle(ctx, d.Pool, t)
	if err == nil && res.EventID != uuid.Nil {
		d.tl.begin(res.EventID, start, time.Now())
	}
	return res, err
}

func (d *demo) report(ctx context.Context) fraud.Report {
	rep, err := fraud.ReadReport(ctx, d.Redis, fraud.Keys{Prefix: d.KeyPrefix, Partitions: d.Partitions})
	if err != nil {
		return fraud.Report{}
	}
	return rep
}

// waitFor polls cond until it holds or timeout passes.
func waitFor(ctx context.Context, timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for ctx.Err() == nil && time.Now().Before(deadline) {
		if cond() {
			return true
		}
		time.Sleep(time.Millisecond)
	}
	return cond()
}

func (d *demo) count(ctx context.Context, query string, args ...any) int {
	var n int
	if err := d.Pool.QueryRow(ctx, query, args...).Scan(&n); err != nil {
		return -1
	}
	return n
}

// --- colour -------------------------------------------------------------------

const (
	red    = "31"
	green  = "32"
	yellow = "33"
	dim    = "2"
)

func (d *demo) paint(s, code string) string {
	if !d.Color {
		return s
	}
	return "\x1b[" + code + "m" + s + "\x1b[0m"
}

func (d *demo) bold(s string) string { return d.paint(s, "1") }
