package demo

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/ledger"
	"github.com/tedbank/outbox/reconcile"
	"github.com/tedbank/outbox/transfer"
)

// --- 6 ----------------------------------------------------------------------

// ledgerConfig is the ledger consumer's configuration in the demo.
func (d *demo) ledgerConfig() ledger.Config {
	return ledger.Config{Consumer: consumer.Config{
		Stream: d.StreamPrefix + transfer.AggregateType, KeyPrefix: d.LedgerKeyPrefix, Consumer: "demo-ledger",
		Partitions: d.Partitions, PartitionLease: 2 * time.Second, Block: 200 * time.Millisecond, Logger: d.Logger,
	}}
}

// ensureLedgerGroup creates the ledger's consumer group before the first
// TED, so that the relays keep every entry until the ledger has read it:
// the ledger starts late, in scenario 6, and catches up on the whole demo.
func (d *demo) ensureLedgerGroup(ctx context.Context) error {
	if d.LedgerURL == "" {
		return nil
	}
	db, err := pgxpool.New(ctx, d.LedgerURL)
	if err != nil {
		return fmt.Errorf("ledger database: %w", err)
	}
	defer db.Close()
	c, err := ledger.New(db, d.Redis, d.ledgerConfig())
	if err != nil {
		return err
	}
	return c.EnsureGroup(ctx)
}

func (d *demo) ledgerCrash(ctx context.Context) error {
	if d.LedgerURL == "" || !d.FailPoints {
		d.notRun++
		fmt.Fprintln(d.Out, "   not run: it needs a database of the ledger's own and fail points (make demo has both)")
		return nil
	}
	db, err := pgxpool.New(ctx, d.LedgerURL)
	if err != nil {
		return fmt.Errorf("ledger database: %w", err)
	}
	defer db.Close()
	if err := ledger.Migrate(ctx, db); err != nil {
		return err
	}
	// A relay marks a batch published after its consumers may have judged
	// it: wait for the last marks, so that the count holds every TED of the
	// demo (a count taken a moment early left reconcile one transfer more to
	// check than it: 808 against 807, each posted once).
	waitFor(ctx, 10*time.Second, func() bool {
		return d.count(ctx, "SELECT count(*) FROM outbox_messages WHERE unpublished AND created_at >= $1", d.started) == 0
	})
	published := d.count(ctx, "SELECT count(*) FROM outbox_messages WHERE status = 'published' AND created_at >= $1", d.started)
	fmt.Fprintf(d.Out, "   the ledger (package ledger) posts each TED as a debit and a credit in its own database, in the\n"+
		"   transaction that records the event id in its inbox; it starts now and reads the %d TEDs of this demo\n", published)

	// The real binary, SIGKILLed once its second batch has committed and
	// before its XACK: that batch is redelivered to the restarted consumer.
	doomedCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(doomedCtx, d.Binary, "ledger", "--ledger-database-url", d.LedgerURL,
		"--stream", d.StreamPrefix+transfer.AggregateType, "--key-prefix", d.LedgerKeyPrefix, "--consumer", "demo-ledger",
		"--partitions", strconv.Itoa(max(d.Partitions, 1)), "--batch", "100", "--block", "200ms", "--log-level", "error")
	cmd.Env = append(os.Environ(), "DATABASE_URL="+d.DatabaseURL, "REDIS_URL="+d.RedisURL,
		"OUTBOX_FAILPOINT=ledger.after-effect:2", "REDIS_CLUSTER="+strconv.FormatBool(d.Cluster))
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	killed := errors.As(err, &exit) && strings.Contains(exit.String(), "killed") && doomedCtx.Err() == nil
	d.check(killed, "the ledger process died after committing a batch, before acknowledging it (%v)",
		strings.TrimSpace(string(out)+" "+fmt.Sprint(err)))
	entries := d.ledgerEntries(ctx, db)
	fmt.Fprintf(d.Out, "   it died with %d transfers posted; restarted under its name, it reads its unacknowledged batch again\n", entries/2)

	c, err := ledger.New(db, d.viaProxy, d.ledgerConfig())
	if err != nil {
		return err
	}
	bg, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(bg) }()
	defer func() { stop(); <-done }()
	started := time.Now()
	caughtUp := waitFor(ctx, time.Minute, func() bool {
		return d.ledgerEntries(ctx, db) >= 2*published && c.Stats().Duplicates > 0
	})
	st := c.Stats()
	fmt.Fprintf(d.Out, "   caught up in %.1fs: %d posted now, %d skipped as already posted (their inbox rows were there)\n",
		time.Since(started).Seconds(), st.Processed, st.Duplicates)
	d.check(caughtUp, "every published TED reached the ledger after the crash")

	rep, err := reconcile.Run(ctx, d.Pool, d.Redis, reconcile.Options{
		Since: d.started, Grace: time.Nanosecond, Stream: d.StreamPrefix + transfer.AggregateType, KeyPrefix: d.KeyPrefix,
		Partitions: d.Partitions, Ledger: db,
	})
	if err != nil {
		return err
	}
	l := rep.Ledger
	d.check(l.Checked == published && l.NotPosted.Count == 0 && l.Doubled.Count == 0 && l.Wrong.Count == 0,
		"reconcile: %d transfers checked, each posted exactly once (%d missing, %d twice, %d wrong)",
		l.Checked, l.NotPosted.Count, l.Doubled.Count, l.Wrong.Count)
	return d.compareBalances(ctx, db)
}

// ledgerEntries counts the ledger's entries.
func (d *demo) ledgerEntries(ctx context.Context, db *pgxpool.Pool) int {
	var n int
	if err := db.QueryRow(ctx, "SELECT count(*) FROM ledger_entries").Scan(&n); err != nil {
		return -1
	}
	return n
}

// compareBalances checks that every account's ledger balance is what the
// demo's transfers add up to, and prints a few.
func (d *demo) compareBalances(ctx context.Context, db *pgxpool.Pool) error {
	rows, err := d.Pool.Query(ctx, `SELECT account, sum(delta)::bigint FROM (
		SELECT from_account AS account, -amount_cents AS delta FROM transfers WHERE settled_at >= $1
		UNION ALL SELECT to_account, amount_cents FROM transfers WHERE settled_at >= $1) t GROUP BY account`, d.started)
	if err != nil {
		return err
	}
	want := map[string]int64{}
	var acct string
	var delta int64
	if _, err := pgx.ForEachRow(rows, []any{&acct, &delta}, func() error { want[acct] = delta; return nil }); err != nil {
		return err
	}
	bs, err := ledger.Balances(ctx, db)
	if err != nil {
		return err
	}
	differ := 0
	for _, b := range bs {
		if want[b.Account] != b.BalanceCents {
			differ++
		}
		delete(want, b.Account)
	}
	differ += len(want) // accounts the ledger does not have
	for _, b := range bs {
		if b.Account == "ana" || b.Account == "bruno" || b.Account == "iris" {
			fmt.Fprintf(d.Out, "   %-6s R$ %12s  entries: %d\n", b.Account, transfer.FormatBRL(b.BalanceCents), b.Entries)
		}
	}
	d.check(differ == 0, "the balances of all %d accounts equal the sums of their transfers (%d differ)", len(bs), differ)
	return nil
}
