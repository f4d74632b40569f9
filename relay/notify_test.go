package relay_test

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/relaytest"
	"github.com/tedbank/outbox/transfer"
)

// The notify trigger stays quiet while the relay drains, and the relay's way
// back to sleep waits for writers that saw it busy: a writer that read "busy"
// and commits after the relay's last claim is still picked up at once, not at
// the fallback poll (ten minutes here).
func TestWriterThatSawRelayBusyIsNotLeftForThePoll(t *testing.T) {
	t.Parallel()
	// A writer that commits while the relay waits for the lock (20 ms at
	// most), and one that is still in its transaction when the wait ends.
	// Zero: commit as soon as the relay is seen waiting.
	for _, open := range []time.Duration{0, 15 * time.Millisecond, 300 * time.Millisecond} {
		t.Run(open.String(), func(t *testing.T) { testWriterThatSawRelayBusy(t, open) })
	}
}

func testWriterThatSawRelayBusy(t *testing.T, open time.Duration) {
	testWriterThatSawRelayBusyIn(t, open, nil)
}

// testWriterThatSawRelayBusyIn runs the relay and the writer on connections
// with the run-time parameters params.
func testWriterThatSawRelayBusyIn(t *testing.T, open time.Duration, params map[string]string) {
	f := newFixture(t)
	if params != nil {
		f.Pool = f.PoolWith(params)
	}
	busy, held := f.heldBusyRelay()
	r := busy.r
	time.Sleep(100 * time.Millisecond) // let the listener count the notifications sent so far
	notified := r.Stats().Notifications

	// A writer inserts (the trigger reads the flag), sees "busy", does not
	// notify, and commits only after the relay has tried to go back to
	// sleep: the relay must not sleep until the writer's row is claimed.
	tx, err := f.Pool.Begin(f.Ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(f.Ctx) }()
	ted := transfer.Transfer{ID: uuid.New(), FromAccount: "a", ToAccount: "b", AmountCents: 1}
	if _, err := transfer.SettleTx(f.Ctx, tx, ted); err != nil {
		t.Fatal(err)
	}
	held.release()
	if open > 0 {
		time.Sleep(open) // the relay tries to sleep meanwhile
	} else {
		// Commit exactly while the relay waits for the writers that saw it
		// busy (outbox_relay_sleep's lock wait, 20 ms at most).
		outboxtest.Eventually(t, 5*time.Second, func() bool {
			return f.Count(`SELECT count(*) FROM pg_stat_activity
				WHERE datname = current_database() AND wait_event_type = 'Lock' AND wait_event = 'advisory'
				  AND query LIKE '%outbox_relay_sleep%'`) > 0
		}, "the relay never waited for the writer")
	}
	if err := tx.Commit(f.Ctx); err != nil {
		t.Fatal(err)
	}

	outboxtest.Eventually(t, 5*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE aggregate_id = $1 AND status = 'published'", ted.ID.String()) == 1
	}, "a row committed by a writer that saw the relay busy waited for the fallback poll")
	if st := r.Stats(); st.Notifications != notified || st.Polls != 0 {
		t.Fatalf("stats %+v: want no notification after %d (the writer saw the relay busy) and no poll", st, notified)
	}
	outboxtest.Eventually(t, 5*time.Second, func() bool { return f.IdleFlag() == 1 }, "relay did not go back to sleep")
}

// Under a steady trickle, writers stop notifying once the relay is busy, and
// every event is still published without the fallback poll.
func TestNotifyOnlyWhileRelaySleeps(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	r := f.NewRelay(f.RelayConfig("r1"), nil)
	sig := relaytest.Signals(r)
	f.Run(r.Run)
	relaytest.WaitCaughtUp(t, sig, 0) // asleep: the first commit must wake it

	const writers, each = 4, 100
	errs := make(chan error, writers)
	for w := range writers {
		go func() {
			for i := range each {
				// Senders of their own: one key would keep the drain
				// going the whole time (each round trip publishes the
				// key's next event), and no notification would be needed.
				ted := transfer.Transfer{ID: uuid.New(), FromAccount: fmt.Sprintf("w%d-%d", w, i%8), ToAccount: "b", AmountCents: int64(w*each + i + 1)}
				if _, err := transfer.Settle(f.Ctx, f.Pool, ted); err != nil {
					errs <- err
					return
				}
				if i%10 == 9 {
					// A trickle, not a flood: the relay catches up
					// between waves and must be woken again.
					time.Sleep(5 * time.Millisecond)
				}
			}
			errs <- nil
		}()
	}
	for range writers {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	// Progress, not a deadline: with the poll at ten minutes, a relay
	// asleep while writers are silent stops publishing altogether, where a
	// loaded machine only slows it (when the events shared one key, each
	// round trip published one: 400 round trips took more than 10 s once
	// in .ci/run, 208 events in).
	for published, last, since := 0, -1, time.Now(); published < writers*each; time.Sleep(20 * time.Millisecond) {
		published = f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'")
		if published != last {
			last, since = published, time.Now()
		}
		if time.Since(since) > 5*time.Second {
			t.Fatalf("%d of %d events published, and none more for 5 s: the relay waits for its fallback poll (stats %+v)",
				published, writers*each, r.Stats())
		}
	}
	st := r.Stats()
	if st.Polls != 0 {
		t.Fatalf("stats %+v: the fallback poll ran", st)
	}
	t.Logf("%d events, %d notifications", writers*each, st.Notifications)
	outboxtest.Eventually(t, 5*time.Second, func() bool { return f.IdleFlag() == 1 }, "relay did not go back to sleep")
}

// A relay that died while draining leaves writers silent; the next fallback
// poll of any relay tells them to notify again.
func TestPollReassertsSleepAfterARelayDiedBusy(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	cfg := f.RelayConfig("r1")
	cfg.PollInterval = 100 * time.Millisecond
	r := f.NewRelay(cfg, nil)
	f.Run(r.Run)
	outboxtest.Eventually(t, 5*time.Second, func() bool { return r.Stats().Polls > 0 }, "relay never polled")
	if _, err := f.Pool.Exec(f.Ctx, "SELECT outbox_relay_busy()"); err != nil { // the dead relay's last word
		t.Fatal(err)
	}
	outboxtest.Eventually(t, 5*time.Second, func() bool { return f.IdleFlag() == 1 }, "the poll did not tell writers to notify again")
}

func TestNotifyModeSwitches(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	mode := func(m string) (string, error) {
		var prev string
		err := f.Pool.QueryRow(f.Ctx, "SELECT outbox_notify_mode($1)", m).Scan(&prev)
		return prev, err
	}
	// BEFORE since migration 0014 (AFTER cost the writers the after-trigger
	// queue); a statement trigger: a row trigger returning NULL would drop
	// every row.
	triggers := func() string { return outboxtest.NotifyTrigger(t, f.Pool) }
	for _, step := range []struct{ mode, prev, fn string }{
		{"idle", "idle", "outbox_messages_notify_idle before statement"}, // the migrations' default
		{"always", "idle", "outbox_messages_notify before statement"},
		{"off", "always", ""},
		{"off", "off", ""},
		{"idle", "off", "outbox_messages_notify_idle before statement"},
		{"after", "", "outbox_messages_notify_idle after statement"},     // as before 0014, by hand
		{"idle", "idle", "outbox_messages_notify_idle before statement"}, // made BEFORE again
	} {
		if step.mode == "after" {
			f.Exec(`DROP TRIGGER outbox_messages_notify ON outbox_messages;
				CREATE TRIGGER outbox_messages_notify AFTER INSERT ON outbox_messages
					FOR EACH STATEMENT EXECUTE FUNCTION outbox_messages_notify_idle()`)
		} else if prev, err := mode(step.mode); err != nil {
			t.Fatal(err)
		} else if prev != step.prev {
			t.Fatalf("outbox_notify_mode(%q) = %q, want %q", step.mode, prev, step.prev)
		}
		if got := triggers(); got != step.fn {
			t.Fatalf("after outbox_notify_mode(%q) the trigger is %q, want %q", step.mode, got, step.fn)
		}
		// Every mode keeps the row (a BEFORE row trigger returning NULL
		// would drop it).
		ted := transfer.Transfer{ID: uuid.New(), FromAccount: "a", ToAccount: "b", AmountCents: 1}
		if _, err := transfer.Settle(f.Ctx, f.Pool, ted); err != nil {
			t.Fatal(err)
		}
		if n := f.Count("SELECT count(*) FROM outbox_messages WHERE aggregate_id = $1", ted.ID.String()); n != 1 {
			t.Fatalf("mode %s: %d outbox rows for the transfer, want 1", step.mode, n)
		}
	}
	_, err := mode("sometimes")
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "22023" {
		t.Fatalf("unknown mode: got %v, want invalid_parameter_value", err)
	}
}

// A writer's insert that fails after the notify trigger took the shared lock
// (the trigger runs before the insert since migration 0014) leaves no lock
// behind when the writer rolls back to a savepoint and goes on: the relay's
// way back to sleep must not wait for it until its transaction ends.
func TestFailedInsertInASavepointLeavesNoWriterLock(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ted := transfer.Transfer{ID: uuid.New(), FromAccount: "a", ToAccount: "b", AmountCents: 1}
	if _, err := transfer.Settle(f.Ctx, f.Pool, ted); err != nil {
		t.Fatal(err)
	}
	f.Exec("SELECT outbox_relay_busy(0)") // a relay drains: writers that insert take the shared lock
	tx, err := f.Pool.Begin(f.Ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(f.Ctx) }()
	locks := func() int {
		var n int
		if err := tx.QueryRow(f.Ctx, `SELECT count(*) FROM pg_locks
			WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND classid = 1869903214 AND objid = 1`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if _, err := tx.Exec(f.Ctx, "SAVEPOINT s"); err != nil {
		t.Fatal(err)
	}
	// The same event id again: the trigger runs, then the insert fails.
	_, err = tx.Exec(f.Ctx, `INSERT INTO outbox_messages (id, aggregate_type, aggregate_id, event_type, payload)
		SELECT id, aggregate_type, aggregate_id, event_type, payload FROM outbox_messages WHERE aggregate_id = $1`, ted.ID.String())
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23505" {
		t.Fatalf("duplicate insert: got %v, want unique_violation", err)
	}
	if _, err := tx.Exec(f.Ctx, "ROLLBACK TO SAVEPOINT s"); err != nil {
		t.Fatal(err)
	}
	if n := locks(); n != 0 {
		t.Fatalf("the writer still holds %d shared locks after rolling its failed insert back", n)
	}
	// The trigger did take it: an insert that succeeds holds it to the end.
	if _, err := tx.Exec(f.Ctx, `INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload)
		VALUES ('transfer', $1, 'transfer.settled', '{}')`, uuid.NewString()); err != nil {
		t.Fatal(err)
	}
	if n := locks(); n != 1 {
		t.Fatalf("the writer holds %d shared locks after an insert with the relay busy, want 1", n)
	}
}

// outbox_relay_sleep never leaves its lock behind, whether it got it or timed
// out waiting for a writer that saw the relay busy: a leaked lock would stall
// every writer that reads the flag as 0.
func TestRelaySleepLeavesNoLockBehind(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	conn, err := f.Pool.Acquire(f.Ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	held := func() int {
		var n int
		if err := conn.QueryRow(f.Ctx, `SELECT count(*) FROM pg_locks
			WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	sleep := func() bool {
		var ok bool
		if err := conn.QueryRow(f.Ctx, "SELECT outbox_relay_sleep()").Scan(&ok); err != nil {
			t.Fatal(err)
		}
		return ok
	}
	if !sleep() || held() != 0 {
		t.Fatal("sleep without writers: want true and no lock held afterwards")
	}

	// A writer that read the flag as 0 holds the shared lock.
	writer, err := f.Pool.Begin(f.Ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = writer.Rollback(f.Ctx) }()
	if _, err := writer.Exec(f.Ctx, "SELECT pg_advisory_xact_lock_shared(1869903214, 1)"); err != nil {
		t.Fatal(err)
	}
	if sleep() || held() != 0 {
		t.Fatal("sleep with a writer in flight: want false and no lock held afterwards")
	}
	if err := writer.Commit(f.Ctx); err != nil {
		t.Fatal(err)
	}
	if !sleep() || held() != 0 {
		t.Fatal("sleep after the writer finished: want true and no lock held afterwards")
	}
}
