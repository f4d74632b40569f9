package relay_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/relaytest"
	"github.com/tedbank/outbox/internal/tcpproxy"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/transfer"
)

// With the fallback poll at ten minutes, only NOTIFY can bring the relay to a
// newly committed event quickly.
func TestNotifyWakesRelay(t *testing.T) {
	f := newFixture(t)
	r := f.NewRelay(f.RelayConfig("r1"), nil)
	sig := relaytest.Signals(r)
	f.Run(r.Run)
	relaytest.WaitCaughtUp(t, sig, 0) // the start-up drains are over

	for i := range 5 {
		// Writers notify only while the relay sleeps (migration 0006).
		outboxtest.Eventually(t, 5*time.Second, func() bool { return f.IdleFlag() == 1 }, "relay never went to sleep")
		teds := f.Settle(1)
		committed := time.Now()
		outboxtest.Eventually(t, 5*time.Second, func() bool {
			return f.Count("SELECT count(*) FROM outbox_messages WHERE aggregate_id = $1 AND status = 'published'", teds[0].ID.String()) == 1
		}, "event %d not published; the relay was not woken by NOTIFY", i)
		t.Logf("event %d published %.2f ms after commit", i, float64(time.Since(committed).Microseconds())/1000)
	}
	if got := len(f.Entries(f.Stream())); got != 5 {
		t.Fatalf("stream holds %d entries, want 5", got)
	}
	st := r.Stats()
	if st.Notifications < 5 || st.Polls != 0 {
		t.Fatalf("stats %+v: want >= 5 notifications and no fallback poll", st)
	}
}

// NOTIFY is only a hint: with the trigger gone, the fallback poll still
// delivers everything.
func TestFallbackPollDeliversWithoutNotify(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	if _, err := f.Pool.Exec(f.Ctx, "DROP TRIGGER outbox_messages_notify ON outbox_messages"); err != nil {
		t.Fatal(err)
	}
	cfg := f.RelayConfig("r1")
	cfg.PollInterval = 100 * time.Millisecond
	r := f.NewRelay(cfg, nil)
	f.Run(r.Run)
	// Commit only after the start-up drain and the wake-up that follows the
	// first LISTEN have both been consumed, so that only a poll can find the
	// rows: wait for the listener, then for two polls after it (the drain
	// loop may pick a ready poll tick before a pending wake-up).
	outboxtest.Eventually(t, 10*time.Second, func() bool { return r.Stats().ListenUp }, "relay never LISTENed")
	if r.Ownership() == relay.OwnPartitions {
		// A partition owner drains when it takes slots: wait until it holds
		// them all, or a late take (a loaded machine) finds the rows first
		// (a .ci/run's auto lane: Polls 2, PollsWithWork 0).
		outboxtest.Eventually(t, 10*time.Second, func() bool {
			return f.Count(`SELECT count(*) FROM outbox_relay_partitions WHERE owner = 'r1' AND lease_until > now()`) ==
				f.Count(`SELECT count(*) FROM outbox_relay_partitions`)
		}, "the relay does not hold every slot")
	}
	polls := r.Stats().Polls
	outboxtest.Eventually(t, 5*time.Second, func() bool { return r.Stats().Polls >= polls+2 }, "relay never polled")
	f.Settle(20)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 20
	}, "events not published by the fallback poll")
	// The drain that found them ends (and is counted) a claim or two later.
	outboxtest.Eventually(t, 5*time.Second, func() bool { return r.Stats().PollsWithWork > 0 },
		"stats %+v: want a poll that found work", r.Stats())
	if st := r.Stats(); st.Notifications != 0 {
		t.Fatalf("stats %+v: want no notification", st)
	}
}

// A killed LISTEN connection is re-established; events committed while it was
// down are caught up right after the new LISTEN, not at the next poll.
func TestListenReconnectsAndCatchesUp(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	r := f.NewRelay(f.RelayConfig("r1"), nil)
	f.Run(r.Run)
	outboxtest.Eventually(t, 5*time.Second, func() bool { return r.Stats().ListenUp }, "relay never LISTENed")

	listeners := func() int {
		return f.Count(`SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND application_name = 'outbox-test-listen'`)
	}
	for round := range 3 {
		outboxtest.Eventually(t, 10*time.Second, func() bool { return r.Stats().ListenUp && listeners() == 1 },
			"round %d: relay not LISTENing", round)
		// Kill the listener and commit events before it can come back.
		tx, err := f.Pool.Begin(f.Ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(f.Ctx) }() // a no-op once committed; frees the connection on failure
		var killed int
		if err := tx.QueryRow(f.Ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
			WHERE datname = current_database() AND application_name = 'outbox-test-listen'`).Scan(&killed); err != nil {
			t.Fatal(err)
		}
		if killed != 1 {
			t.Fatalf("round %d: terminated %d listen connections, want 1", round, killed)
		}
		for range 10 {
			if _, err := transfer.SettleTx(f.Ctx, tx, transfer.Transfer{ID: uuid.New(), FromAccount: "a", ToAccount: "b", AmountCents: 1}); err != nil {
				t.Fatal(err)
			}
		}
		if err := tx.Commit(f.Ctx); err != nil {
			t.Fatal(err)
		}
		outboxtest.Eventually(t, 10*time.Second, func() bool {
			return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 10*(round+1)
		}, "round %d: events committed while the listener was down were not caught up", round)
	}
	if st := r.Stats(); st.Polls != 0 {
		t.Fatalf("stats %+v: caught up by the fallback poll, not by the reconnect", st)
	}
}

// A half-open LISTEN connection (no RST, no FIN: the peer just went silent) is
// noticed by the ping after a quiet poll interval and replaced.
func TestHalfOpenListenConnectionIsReplaced(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	cfg := f.RelayConfig("r1")
	listen, err := pgx.ParseConfig(f.DBURL)
	if err != nil {
		t.Fatal(err)
	}
	proxy, err := tcpproxy.Start(fmt.Sprintf("%s:%d", listen.Host, listen.Port))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = proxy.Close() })
	relaytest.ViaProxy(&listen.Config, proxy)
	listen.RuntimeParams["application_name"] = "outbox-test-listen"
	cfg.ListenConfig = listen
	cfg.PollInterval = 500 * time.Millisecond
	r := f.NewRelay(cfg, nil)
	f.Run(r.Run)
	outboxtest.Eventually(t, 5*time.Second, func() bool { return r.Stats().ListenUp }, "relay never LISTENed")
	pidOf := func() int {
		var pid int
		_ = f.Pool.QueryRow(f.Ctx, `SELECT coalesce(max(pid), 0) FROM pg_stat_activity
			WHERE datname = current_database() AND application_name = 'outbox-test-listen'`).Scan(&pid)
		return pid
	}
	before := pidOf()
	proxy.Freeze()
	outboxtest.Eventually(t, 20*time.Second, func() bool { p := pidOf(); return p != 0 && p != before && r.Stats().ListenUp },
		"the half-open LISTEN connection was never replaced")
	n0 := r.Stats().Notifications
	f.Settle(1)
	outboxtest.Eventually(t, 5*time.Second, func() bool { return r.Stats().Notifications > n0 },
		"no notification on the new LISTEN connection")
}
