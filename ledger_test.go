package outbox_test

import (
	"context"
	"fmt"
	"github.com/tedbank/outbox/internal/relaytest"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/ledger"
	"github.com/tedbank/outbox/reconcile"
	"github.com/tedbank/outbox/transfer"
)

// ledgerFixture is a fixture plus the ledger example's own database.
type ledgerFixture struct {
	*fixture
	ledgerURL string
	ledgerDB  *pgxpool.Pool
}

func newLedgerFixture(t *testing.T) *ledgerFixture {
	t.Helper()
	f := &ledgerFixture{fixture: newFixture(t), ledgerURL: outboxtest.PostgresURL(t)}
	db, err := pgxpool.New(context.Background(), f.ledgerURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	if err := ledger.Migrate(context.Background(), db); err != nil {
		t.Fatal(err)
	}
	f.ledgerDB = db
	return f
}

func (f *ledgerFixture) ledgerConfig(name string) ledger.Config {
	return ledger.Config{Consumer: consumer.Config{
		Stream: f.Stream(), KeyPrefix: f.Redis.Prefix + "ledger:", Consumer: name, Partitions: f.partitions,
		Block: 100 * time.Millisecond, ClaimInterval: 100 * time.Millisecond, ClaimMinIdle: 500 * time.Millisecond,
	}}
}

// ledgerArgs runs the ledger command as ledgerConfig does.
func (f *ledgerFixture) ledgerArgs(name string) []string {
	return []string{"ledger", "--ledger-database-url", f.ledgerURL, "--stream", f.Stream(), "--key-prefix", f.Redis.Prefix + "ledger:",
		"--consumer", name, "--block", "100ms", "--claim-interval", "100ms", "--claim-min-idle", "500ms",
		"--partitions", fmt.Sprint(max(f.partitions, 1))}
}

// postings counts each transfer's double entries in the ledger (-1: its
// entries are not its debit and credit).
func (f *ledgerFixture) postings(teds []transfer.Transfer) map[uuid.UUID]int {
	f.T.Helper()
	rows, err := f.ledgerDB.Query(f.Ctx, `SELECT transfer_id, account, amount_cents FROM ledger_entries`)
	if err != nil {
		f.T.Fatal(err)
	}
	type entry struct {
		account string
		cents   int64
	}
	byTransfer := map[uuid.UUID][]entry{}
	var id uuid.UUID
	var e entry
	if _, err := pgx.ForEachRow(rows, []any{&id, &e.account, &e.cents}, func() error {
		byTransfer[id] = append(byTransfer[id], e)
		return nil
	}); err != nil {
		f.T.Fatal(err)
	}
	out := map[uuid.UUID]int{}
	for _, t := range teds {
		debits, credits := 0, 0
		for _, e := range byTransfer[t.ID] {
			switch e {
			case entry{t.FromAccount, -t.AmountCents}:
				debits++
			case entry{t.ToAccount, t.AmountCents}:
				credits++
			default:
				debits = -1 << 20
			}
		}
		out[t.ID] = debits
		if debits != credits || debits < 0 {
			out[t.ID] = -1
		}
	}
	return out
}

// checkPostedOnce: every transfer is posted exactly once, the balances are
// the transfers' sums, and reconcile agrees.
func (f *ledgerFixture) checkPostedOnce(teds []transfer.Transfer) {
	f.T.Helper()
	for id, n := range f.postings(teds) {
		if n != 1 {
			f.T.Errorf("transfer %s posted %d times, want once", id, n)
		}
	}
	want := map[string]int64{}
	for _, t := range teds {
		want[t.FromAccount] -= t.AmountCents
		want[t.ToAccount] += t.AmountCents
	}
	bs, err := ledger.Balances(f.Ctx, f.ledgerDB)
	if err != nil {
		f.T.Fatal(err)
	}
	got := map[string]int64{}
	for _, b := range bs {
		got[b.Account] = b.BalanceCents
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		f.T.Errorf("balances %v, want the transfers' sums %v", got, want)
	}
}

// waitPosted waits until every transfer has entries and backlog() (the
// group's unacknowledged and undelivered messages) is 0.
func (f *ledgerFixture) waitPosted(teds []transfer.Transfer, backlog func() int64) {
	f.T.Helper()
	outboxtest.Eventually(f.T, 20*time.Second, func() bool {
		for _, n := range f.postings(teds) {
			if n == 0 {
				return false
			}
		}
		return backlog() == 0
	}, "the ledger never posted every transfer and acknowledged it")
}

// pendingInRedis is the ledger group's pending entries on Redis Streams.
func (f *ledgerFixture) pendingInRedis() int64 {
	p, err := f.Redis.XPending(f.Ctx, f.Stream(), ledger.DefaultGroup).Result()
	if err != nil {
		return -1
	}
	return p.Count
}

// A ledger consumer killed at each point of the inbox path — after reading,
// after the inbox insert, before the commit, after the commit and before the
// XACK — and restarted under its name posts every TED exactly once: the
// balances equal the transfers, and reconcile finds nothing. (Remove the
// inbox insert and the kill after the commit posts the batch twice.)
func TestLedgerCrashAtEveryPointPostsEachTransferOnce(t *testing.T) {
	for _, point := range []struct {
		failpoint string
		committed bool // the batch's postings are in the ledger when the process dies
	}{
		{"ledger.after-read", false},
		{"inbox.after-insert", false},
		{"inbox.before-commit", false},
		{"ledger.after-effect", true},
	} {
		t.Run(point.failpoint, func(t *testing.T) {
			f := newLedgerFixture(t)
			teds := f.Settle(6)
			if res, err := relaytest.DrainBatch(f.Ctx, f.NewRelay(f.RelayConfig("r1"), nil)); err != nil || res.Published != 6 {
				t.Fatalf("publish: %+v %v", res, err)
			}
			f.RunUntilKilled(f.OutboxCmd(point.failpoint, f.ledgerArgs("c1")...))
			posted := 0
			for _, n := range f.postings(teds) {
				posted += n
			}
			if want := map[bool]int{true: 6, false: 0}[point.committed]; posted != want {
				t.Fatalf("%d transfers posted when the process died at %s, want %d", posted, point.failpoint, want)
			}
			p, err := f.Redis.XPending(f.Ctx, f.Stream(), ledger.DefaultGroup).Result()
			if err != nil || p.Count != 6 {
				t.Fatalf("pending %+v (%v), want the 6 entries read and not acknowledged", p, err)
			}
			// Restarted under its name, with claiming off: only re-reading
			// its own pending entries brings them back.
			cfg := f.ledgerConfig("c1")
			cfg.Consumer.ClaimInterval = time.Hour
			c, err := ledger.New(f.ledgerDB, f.Redis.Client, cfg)
			if err != nil {
				t.Fatal(err)
			}
			f.Run(c.Run)
			f.waitPosted(teds, f.pendingInRedis)
			f.checkPostedOnce(teds)
			if st := c.Stats(); point.committed && st.Duplicates != 6 || !point.committed && st.Processed != 6 {
				t.Errorf("stats after the restart %+v: want the 6 entries %s", st, map[bool]string{true: "skipped as duplicates", false: "applied"}[point.committed])
			}
			rep, err := reconcile.Run(f.Ctx, f.Pool, f.Redis.Client, reconcile.Options{
				Since: time.Now().Add(-time.Hour), Stream: f.Stream(), KeyPrefix: f.keyPrefix(), Now: time.Now().Add(2 * time.Minute),
				Ledger: f.ledgerDB,
			})
			if err != nil {
				t.Fatal(err)
			}
			if l := rep.Ledger; l == nil || l.Checked != 6 || l.NotPosted.Count+l.Doubled.Count+l.Wrong.Count != 0 {
				t.Errorf("reconcile's ledger check: %+v, want 6 checked, nothing differing", l)
			}
		})
	}
}

// outbox reconcile with the ledger's database finds, after a clean run,
// nothing in the ledger; then each planted difference, and only it: a
// transfer whose entries are gone, one posted twice, one posted with
// another amount.
func TestReconcileFindsLedgerDifferences(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	teds := f.Settle(10)
	f.DrainAll(f.NewRelay(f.RelayConfig("r1"), nil))
	c, err := ledger.New(f.ledgerDB, f.Redis.Client, f.ledgerConfig("c1"))
	if err != nil {
		t.Fatal(err)
	}
	stop := f.Run(c.Run)
	f.waitPosted(teds, f.pendingInRedis)
	stop()
	run := func() *reconcile.LedgerReport {
		t.Helper()
		rep, err := reconcile.Run(f.Ctx, f.Pool, f.Redis.Client, reconcile.Options{
			Since: time.Now().Add(-time.Hour), Stream: f.Stream(), KeyPrefix: f.keyPrefix(), Now: time.Now().Add(2 * time.Minute),
			Ledger: f.ledgerDB,
		})
		if err != nil {
			t.Fatal(err)
		}
		return rep.Ledger
	}
	if l := run(); l.Checked != 10 || l.NotPosted.Count+l.Doubled.Count+l.Wrong.Count != 0 {
		t.Fatalf("clean run: %+v", l)
	}
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := f.ledgerDB.Exec(f.Ctx, sql, args...); err != nil {
			t.Fatal(err)
		}
	}
	exec(`DELETE FROM ledger_entries WHERE transfer_id = $1`, teds[0].ID)
	exec(`INSERT INTO ledger_entries (transfer_id, event_id, account, amount_cents, currency, settled_at)
	      SELECT transfer_id, event_id, account, amount_cents, currency, settled_at FROM ledger_entries WHERE transfer_id = $1`, teds[1].ID)
	exec(`UPDATE ledger_entries SET amount_cents = amount_cents * 2 WHERE transfer_id = $1`, teds[2].ID)
	l := run()
	for _, d := range []struct {
		name string
		got  reconcile.Diff
		want uuid.UUID
	}{{"not posted", l.NotPosted, teds[0].ID}, {"posted twice", l.Doubled, teds[1].ID}, {"wrong entries", l.Wrong, teds[2].ID}} {
		if d.got.Count != 1 || d.got.Examples[0] != d.want.String() {
			t.Errorf("%s: %+v, want just %s", d.name, d.got, d.want)
		}
	}
}
