package outbox_test

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/testenv"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/relay/redisbroker"
	"github.com/tedbank/outbox/transfer"
)

// startPgBouncer starts a PgBouncer of the test's own in front of dbURL. CI
// installs the pgbouncer package (.ci/run) and sets CI, and there a missing
// binary fails the test; elsewhere it is skipped with the install hint.
func startPgBouncer(t *testing.T, dbURL, mode string) *testenv.Server {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	srv, err := testenv.LocalPgBouncer(ctx, dbURL, mode, testenv.Options{Log: func(msg string, args ...any) { t.Log(append([]any{msg}, args...)...) }})
	if err != nil {
		if os.Getenv("CI") == "" {
			t.Skipf("no PgBouncer: %v", err)
		}
		t.Fatalf("PgBouncer: %v", err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	return srv
}

// The relay's pool and the writers go through PgBouncer in transaction
// mode, the LISTEN connection goes straight to PostgreSQL (docs/operations.md,
// "PgBouncer"): every statement of the relay works on a pooled server
// connection (claims, marks, the wake-up protocol's advisory locks and
// sequence, the isolation pin), and every event is woken and published, none
// left for the poll (10 minutes here).
func TestRelayThroughPgBouncerTransactionMode(t *testing.T) {
	f := newFixture(t)
	bouncer := startPgBouncer(t, f.DBURL, "transaction")

	pcfg, err := pgxpool.ParseConfig(bouncer.URL)
	if err != nil {
		t.Fatal(err)
	}
	pcfg.ConnConfig.RuntimeParams["application_name"] = "outbox-test-bouncer"
	pcfg.MaxConns = 16
	pcfg.AfterConnect = outbox.RegisterTypes
	pooled, err := pgxpool.NewWithConfig(f.Ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pooled.Close)
	var through string
	if err := pooled.QueryRow(f.Ctx, "SHOW application_name").Scan(&through); err != nil {
		t.Fatalf("query through PgBouncer: %v", err)
	}

	cfg := f.RelayConfig("bounced")
	cfg.BatchSize = 8 // several claims per burst: the relay goes busy and back to sleep
	cfg.ListenConfig = f.Pool.Config().ConnConfig.Copy()
	r, err := relay.New(pooled, f.RedisBroker(nil, redisbroker.Config{}), cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop := f.Run(r.Run)
	defer stop()
	outboxtest.Eventually(t, 10*time.Second, func() bool { return r.Stats().ListenUp }, "LISTEN never came up")

	// Bursts of concurrent writers through PgBouncer, with pauses in which
	// the relay goes to sleep and the next burst must wake it.
	const bursts, writers, perWriter = 5, 8, 10
	want := map[string]bool{}
	var mu sync.Mutex
	for b := range bursts {
		var wg sync.WaitGroup
		for w := range writers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range perWriter {
					tr := transfer.Transfer{ID: uuid.New(), FromAccount: fmt.Sprintf("acct-%02d", w),
						ToAccount: fmt.Sprintf("acct-%02d", 10+i%5), AmountCents: int64(100 + b)}
					res, err := transfer.Settle(f.Ctx, pooled, tr)
					if err != nil {
						t.Errorf("settle through PgBouncer: %v", err)
						return
					}
					mu.Lock()
					want[res.EventID.String()] = true
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		n := len(want)
		outboxtest.Eventually(t, 5*time.Second, func() bool { return len(f.Entries(f.Stream())) >= n },
			fmt.Sprintf("burst %d: not every event published within 5s (the poll is 10 minutes)", b+1))
		time.Sleep(50 * time.Millisecond)
	}
	got := f.Entries(f.Stream())
	seen := map[string]bool{}
	for _, id := range got {
		if !want[id] || seen[id] {
			t.Fatalf("stream entry %s: unknown or duplicated", id)
		}
		seen[id] = true
	}
	if len(seen) != bursts*writers*perWriter {
		t.Fatalf("%d events in the stream, want %d", len(seen), bursts*writers*perWriter)
	}
	outboxtest.Eventually(t, 5*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status <> 'published'") == 0
	}, "rows left unpublished")
	if st := r.Stats(); st.Polls != 0 || st.Notifications == 0 {
		t.Fatalf("stats %+v: want wake-ups by notification, no poll", st)
	}
}
