package relay_test

// The wake-up protocol's edge cases: each test below reproduces one way a
// committed event could be left for the fallback poll (ten minutes in these
// fixtures) or a relay could hang, and asserts it no longer happens. See
// sql/migrations/0006_outbox_notify_idle.sql for the protocol.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/relaytest"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/relay/redisbroker"
	"github.com/tedbank/outbox/transfer"
)

// quick is how soon an event must be published when nothing is wrong: far
// below the fixtures' ten-minute poll, far above a wake-up's milliseconds.
const quick = 3 * time.Second

// publishedQuickly settles one TED and fails unless its event is published
// within quick.
func (f *fixture) publishedQuickly(why string) {
	f.T.Helper()
	ted := f.Settle(1)[0]
	outboxtest.Eventually(f.T, quick, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE aggregate_id = $1 AND status = 'published'", ted.ID.String()) == 1
	}, "a new event waited for the fallback poll: %s", why)
}

// Defect: the mark re-sent on its own after a failed claim had no deadline,
// so a hung statement froze the drain loop and the relay ignored shutdown.
// Here every mark waits on an advisory lock the test holds: the claim that
// carries the mark times out, the mark alone must time out too, and the relay
// must stop.
func TestLoneMarkAfterFailedClaimHasADeadline(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.Exec(`CREATE FUNCTION test_hang_marks() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.status = 'published' THEN
				PERFORM pg_advisory_xact_lock_shared(4242);
			END IF;
			RETURN NEW;
		END $$`)
	f.Exec(`CREATE TRIGGER test_hang_marks BEFORE UPDATE ON outbox_messages
		FOR EACH ROW EXECUTE FUNCTION test_hang_marks()`)
	holder, err := f.Pool.Acquire(f.Ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := holder.Exec(f.Ctx, "SELECT pg_advisory_lock(4242)"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = holder.Exec(context.Background(), "SELECT pg_advisory_unlock(4242)")
		holder.Release()
	})

	// One row per batch: the first batch's mark rides with the second claim.
	f.Settle(3)
	cfg := f.RelayConfig("r1")
	cfg.BatchSize = 1
	r := f.NewRelay(cfg, nil)
	ctx, cancel := context.WithCancel(f.Ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	outboxtest.Eventually(t, 5*time.Second, func() bool {
		return f.Count(`SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND wait_event = 'advisory'`) > 0
	}, "the relay's mark never waited on the lock")
	cancel() // SIGTERM while the mark hangs
	// The claim's deadline (10s), then the lone mark's (3s), then exit.
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(25 * time.Second):
		t.Fatal("relay did not stop within 25s of shutdown while a mark hung: the lone mark has no deadline")
	}
}

// Defect: a round trip that told writers "busy" and then failed left the
// relay believing it was still asleep; it went to sleep with the flag at 0,
// so writers never notified again. One statement error is injected right
// after the flag went to 0, in the claim of the round trip that set it (a
// row claim's UPDATE to publishing: the fault needs row claims).
func TestFailedBusyRoundTripDoesNotLeaveWritersSilent(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.Exec(`CREATE SEQUENCE test_fault_once`)
	f.Exec(`CREATE FUNCTION test_fail_busy_claim() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.status = 'publishing' AND OLD.status = 'pending'
			   AND (SELECT last_value FROM outbox_relay_idle) = 0 THEN
				IF nextval('test_fault_once') = 1 THEN -- nextval is not rolled back
					RAISE EXCEPTION 'injected failure right after the flag went to 0';
				END IF;
			END IF;
			RETURN NEW;
		END $$`)
	f.Exec(`CREATE TRIGGER test_fail_busy_claim BEFORE UPDATE ON outbox_messages
		FOR EACH ROW EXECUTE FUNCTION test_fail_busy_claim()`)

	// One row per batch: the second non-empty claim makes the third say
	// busy; that one fails. The retry then finds the last row alone.
	f.Settle(3)
	cfg := f.RowsRelayConfig("r1")
	cfg.BatchSize = 1
	r := f.NewRelay(cfg, nil)
	f.Run(r.Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 3
	}, "the backlog was not published")
	var fired bool // a new sequence's last_value is already 1: is_called says whether nextval ran
	if err := f.Pool.QueryRow(f.Ctx, "SELECT is_called FROM test_fault_once").Scan(&fired); err != nil || !fired {
		t.Fatalf("the fault was never injected (%v): the test did not exercise the failed busy round trip", err)
	}
	outboxtest.Eventually(t, quick, func() bool { return f.IdleFlag() == 1 }, "relay went to sleep with writers told it is busy")
	f.publishedQuickly("the relay slept after a failed busy round trip")
}

// Defect: the last claim before sleeping relied on READ COMMITTED. Under
// repeatable read (a database or role default) its snapshot predated the
// lock wait, so a writer that saw "busy" and committed during the wait was
// invisible to it. The relay must pin the isolation level it needs.
func TestWriterThatSawRelayBusyUnderRepeatableRead(t *testing.T) {
	t.Parallel()
	for _, open := range []time.Duration{0, 15 * time.Millisecond, 300 * time.Millisecond} {
		t.Run(open.String(), func(t *testing.T) {
			testWriterThatSawRelayBusyIn(t, open, map[string]string{"default_transaction_isolation": "repeatable read"})
		})
	}
}

// failFirstXAdd fails the first XADD to one stream, as WRONGTYPE would.
type failFirstXAdd struct {
	*redis.Client
	stream string
	failed chan struct{} // closed after the failure
}

func (c *failFirstXAdd) Pipelined(ctx context.Context, fn func(redis.Pipeliner) error) ([]redis.Cmder, error) {
	return c.Client.Pipelined(ctx, func(p redis.Pipeliner) error { return fn(failFirstPipe{p, c}) })
}

type failFirstPipe struct {
	redis.Pipeliner
	c *failFirstXAdd
}

func (p failFirstPipe) XAdd(ctx context.Context, a *redis.XAddArgs) *redis.StringCmd {
	if a.Stream == p.c.stream {
		select {
		case <-p.c.failed:
		default:
			close(p.c.failed)
			return redis.NewStringResult("", fmt.Errorf("WRONGTYPE injected"))
		}
	}
	return p.Pipeliner.XAdd(ctx, a)
}

// Defect: a notification cancelled a failed event's retry timer. The event
// fails once and backs off 1s; meanwhile another event wakes the relay. The
// failed event must still be retried at its backoff, not at the poll.
func TestNotificationKeepsFailedEventsRetry(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	rdb := &failFirstXAdd{Client: f.Redis.Client, stream: f.StreamPrefix() + "account", failed: make(chan struct{})}
	cfg := f.RelayConfig("r1")
	cfg.BackoffBase, cfg.BackoffMax = time.Second, time.Second
	r := f.NewRelay(cfg, rdb)
	f.Run(r.Run)
	outboxtest.Eventually(t, 5*time.Second, func() bool { return r.Stats().ListenUp }, "relay never LISTENed")

	err := pgx.BeginFunc(f.Ctx, f.Pool, func(tx pgx.Tx) error {
		_, err := outbox.Write(f.Ctx, tx, outbox.Message{AggregateType: "account", AggregateID: "a1", EventType: "x", Payload: []byte(`{}`)})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-rdb.failed:
	case <-time.After(5 * time.Second):
		t.Fatal("the event was never published")
	}
	outboxtest.Eventually(t, 5*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE aggregate_type = 'account' AND attempts = 1 AND status = 'pending'") == 1
	}, "the first attempt did not fail")
	f.publishedQuickly("another event, published between the failure and its retry")
	outboxtest.Eventually(t, quick, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE aggregate_type = 'account' AND status = 'published'") == 1
	}, "the failed event waited for the poll: a notification dropped its retry timer")
}

// Defect: a relay that stopped gracefully while writers that had seen it busy
// were still in their transactions left their rows for a peer's poll. It
// must wait for them and wake its peers on the way out.
func TestGracefulStopWakesPeersForWritersThatSawItBusy(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	a, held := f.heldBusyRelay()

	// A peer relay, asleep: its start-up drain tells writers to notify. Then
	// the busy relay says busy again (the order of their words in production
	// when one drains while the other sleeps).
	b := f.NewRelay(f.RelayConfig("b"), nil)
	sig := relaytest.Signals(b)
	f.Run(b.Run)
	relaytest.WaitCaughtUp(t, sig, 0) // the drain after its LISTEN has ended too
	outboxtest.Eventually(t, 5*time.Second, func() bool { return f.IdleFlag() == 1 }, "peer never went to sleep")
	f.Exec("SELECT outbox_relay_busy()")

	// A writer sees "busy" (no NOTIFY) and is still in its transaction when
	// the busy relay stops.
	tx, err := f.Pool.Begin(f.Ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(f.Ctx) }()
	ted := transfer.Transfer{ID: uuid.New(), FromAccount: "a", ToAccount: "b", AmountCents: 1}
	if _, err := transfer.SettleTx(f.Ctx, tx, ted); err != nil {
		t.Fatal(err)
	}
	stopped := make(chan struct{})
	go func() { a.stop(); close(stopped) }()
	held.release()
	time.Sleep(100 * time.Millisecond)
	if err := tx.Commit(f.Ctx); err != nil {
		t.Fatal(err)
	}
	<-stopped
	outboxtest.Eventually(t, quick, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE aggregate_id = $1 AND status = 'published'", ted.ID.String()) == 1
	}, "a row of a writer that saw the stopped relay busy waited for the peer's poll")
}

// Defect: after the LISTEN connection came back (as after a PostgreSQL
// crash, which can also undo the flag's last asynchronous change), the
// catch-up drain did not tell writers again that the relay sleeps.
func TestListenReconnectReassertsSleep(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	r := f.NewRelay(f.RelayConfig("r1"), nil)
	sig := relaytest.Signals(r)
	f.Run(r.Run)
	first := relaytest.WaitCaughtUp(t, sig, 0)
	outboxtest.Eventually(t, 5*time.Second, func() bool { return f.IdleFlag() == 1 }, "relay never went to sleep")

	f.Exec("SELECT outbox_relay_busy()") // the flag's last change, undone by a crash
	before := r.Stats().Notifications
	f.Exec(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		WHERE datname = current_database() AND application_name = 'outbox-test-listen'`)
	outboxtest.Eventually(t, 5*time.Second, func() bool { return !r.Stats().ListenUp }, "LISTEN connection not lost")
	// Let the catch-up drain end: a row it claims would need no NOTIFY.
	relaytest.WaitCaughtUp(t, sig, first)
	if got := f.IdleFlag(); got != 1 {
		t.Fatalf("the catch-up drain left writers silent (idle flag %d)", got)
	}
	f.publishedQuickly("the relay's catch-up drain after reconnecting left the flag at busy")
	if r.Stats().Notifications == before {
		t.Fatal("no notification after reconnecting: the event was found some other way")
	}
}

// Defect: a relay killed while draining left the flag at busy, and a relay
// starting afterwards did not tell writers to notify again until its poll.
func TestStartingRelayReassertsSleep(t *testing.T) {
	f := newFixture(t)
	f.Exec("SELECT outbox_relay_busy()") // the killed relay's last word
	r := f.NewRelay(f.RelayConfig("r1"), nil)
	f.Run(r.Run)
	outboxtest.Eventually(t, 5*time.Second, func() bool { return r.Stats().ListenUp }, "relay never LISTENed")
	outboxtest.Eventually(t, quick, func() bool { return f.IdleFlag() == 1 }, "starting relay left writers silent")
	f.publishedQuickly("the starting relay left the flag at busy")
}

// busyRelay is a relay held in its third batch, with writers told it is busy.
type busyRelay struct {
	r    *relay.Relay
	stop func()
}

type hold struct {
	proceed chan struct{}
	once    bool
}

func (h *hold) release() {
	if !h.once {
		h.once = true
		close(h.proceed)
	}
}

// heldBusyRelay starts a relay and holds it in its third batch, right after
// it told writers it is busy, until the hold is released. It drains one event
// per batch from three rows written in one transaction: their one
// notification starts the drain, so no wake-up is left pending that would
// make the relay drain once more after the hold (and hide a stranded row).
func (f *fixture) heldBusyRelay() (busyRelay, *hold) {
	f.T.Helper()
	cfg := f.RelayConfig("busy")
	cfg.BatchSize = 1
	const held = 3
	published := make(chan struct{}, 1)
	h := &hold{proceed: make(chan struct{})}
	calls := 0
	cfg.Observer = relay.Hooks{OnPublish: func([]uuid.UUID) {
		if calls++; calls == held {
			published <- struct{}{}
			<-h.proceed
		}
	}}
	r := f.NewRelay(cfg, nil)
	sig := relaytest.Signals(r)
	stop := f.Run(r.Run)
	f.T.Cleanup(h.release) // before stop runs
	// The wake-up after LISTEN has finished.
	relaytest.WaitCaughtUp(f.T, sig, 0)
	outboxtest.Eventually(f.T, 5*time.Second, func() bool { return f.IdleFlag() == 1 }, "relay never went to sleep")
	err := pgx.BeginFunc(f.Ctx, f.Pool, func(tx pgx.Tx) error {
		for i := range held {
			ted := transfer.Transfer{ID: uuid.New(), FromAccount: fmt.Sprintf("busy-%d", i), ToAccount: "b", AmountCents: 1}
			if _, err := transfer.SettleTx(f.Ctx, tx, ted); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		f.T.Fatal(err)
	}
	select {
	case <-published:
	case <-time.After(5 * time.Second):
		f.T.Fatalf("batch %d never published", held)
	}
	if got := f.IdleFlag(); got != 0 {
		f.T.Fatalf("idle flag %d while the relay drains, want 0", got)
	}
	return busyRelay{r: r, stop: stop}, h
}

// While the database is unreachable the relay backs off instead of retrying
// at a fixed pace, warns once rather than on every attempt, and says at INFO
// when the database and its LISTEN connection are back.
func TestDatabaseOutageBacksOffAndReportsRecovery(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	pool, pgCfg, proxy := f.ProxiedPool("outbox-test-proxied")

	var logs relaytest.SyncBuffer
	cfg := f.RelayConfig("r1")
	cfg.PollInterval = 200 * time.Millisecond // a drain attempt at every poll, were there no backoff
	cfg.Logger = slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	r := f.NewRelayWithPool(pool, cfg)
	f.Run(r.Run)
	outboxtest.Eventually(t, 5*time.Second, func() bool { return r.Stats().ListenUp }, "relay never LISTENed")

	proxy.Down()
	// (A URL without sslmode gets a plain-text fallback that viaProxy must
	// point at the proxy too: this test failed now and then until it did.)
	if c, err := pgx.ConnectConfig(f.Ctx, pgCfg.ConnConfig); err == nil {
		_ = c.Close(f.Ctx)
		t.Fatal("a new connection reached the database while the proxy is down")
	}
	const outage = 4 * time.Second
	time.Sleep(outage)
	ted := f.Settle(1)[0] // committed during the outage (the test's pool is not proxied)
	proxy.Up()
	outboxtest.Eventually(t, 3*drainRetryMaxForTest, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE aggregate_id = $1 AND status = 'published'", ted.ID.String()) == 1
	}, "event committed during the outage not published after it")
	outboxtest.Eventually(t, 5*time.Second, func() bool { return r.Stats().ListenUp }, "LISTEN connection not back")

	outboxtest.Eventually(t, 5*time.Second, func() bool {
		return bytes.Contains(logs.Bytes(), []byte("database reachable again"))
	}, "the relay never said the database is back: %s", logs.Bytes())

	var warns, attempts, reachable, relistened int
	for _, line := range bytes.Split(logs.Bytes(), []byte("\n")) {
		var rec struct{ Level, Msg string }
		if json.Unmarshal(line, &rec) != nil {
			continue
		}
		switch {
		case rec.Msg == "drain failed; retrying":
			attempts++
			if rec.Level == "WARN" {
				warns++
			}
		case rec.Msg == "database reachable again; draining" && rec.Level == "INFO":
			reachable++
		case rec.Msg == "listen connection re-established" && rec.Level == "INFO":
			relistened++
		}
	}
	// Backoff from 100ms doubling to 1s (with jitter, each step at least
	// half its length) fits at most 11 attempts in 4s; one per poll would
	// be 20.
	if attempts == 0 || attempts > 12 || warns != 1 || reachable != 1 || relistened != 1 {
		t.Fatalf("over a %s outage: %d failed drains (want 1..12, backing off), %d warnings (want 1), "+
			"%d INFO 'database reachable again' (want 1), %d INFO 'listen connection re-established' (want 1)\n%s",
			outage, attempts, warns, reachable, relistened, logs.Bytes())
	}
}

// drainRetryMaxForTest is the relay's longest wait between drain attempts
// while the database fails (relay.drainRetryMax).
const drainRetryMaxForTest = time.Second

// The relay's round trips make PostgreSQL say nothing: no WARNING per claim
// (SET TRANSACTION outside a transaction block logged one per round trip,
// 52,000 lines in one benchmark).
func TestRelayRoundTripsRaiseNoNotices(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	cfg, err := pgxpool.ParseConfig(f.DBURL)
	if err != nil {
		t.Fatal(err)
	}
	var notices atomic.Int64
	var last atomic.Value
	cfg.ConnConfig.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		notices.Add(1)
		last.Store(n.Severity + ": " + n.Message)
	}
	pool, err := pgxpool.NewWithConfig(f.Ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	rcfg := f.RelayConfig("quiet")
	rcfg.BatchSize = 2 // several claims, marks, a busy and a sleep
	r, err := relay.New(pool, f.RedisBroker(nil, redisbroker.Config{}), rcfg)
	if err != nil {
		t.Fatal(err)
	}
	stop := f.Run(r.Run)
	f.Settle(10)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 10
	}, "not published")
	stop()
	if n := notices.Load(); n != 0 {
		t.Fatalf("%d notices from the relay's round trips, the last: %v", n, last.Load())
	}
}
