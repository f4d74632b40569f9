package outbox_test

// End-to-end tests of the outbox on a real PostgreSQL and a real Redis:
// settle -> outbox row -> NOTIFY -> relay -> Redis stream -> anti-fraud.
// Crash points are reached by running the real outbox binary with a fail
// point armed (OUTBOX_FAILPOINT), which SIGKILLs it at exactly that point.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox"
	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/tcpproxy"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/transfer"
)

func TestMain(m *testing.M) { outboxtest.MainWithExamples(m) }

// fixture is one test's database, Redis prefix and helpers.
type fixture struct {
	t     *testing.T
	ctx   context.Context
	dbURL string
	pool  *pgxpool.Pool
	rdb   outboxtest.Redis
	// partitions is how many partitions the anti-fraud state is read from
	// (report, checkEffectsOnce); 0 means one.
	partitions int
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	dbURL := outboxtest.PostgresURL(t)
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = "outbox-test"
	cfg.MaxConns = 20
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	return &fixture{t: t, ctx: ctx, dbURL: dbURL, pool: pool, rdb: outboxtest.NewRedis(t)}
}

func (f *fixture) streamPrefix() string { return f.rdb.Prefix + "outbox.event." }
func (f *fixture) stream() string       { return f.streamPrefix() + "transfer" }
func (f *fixture) keyPrefix() string    { return f.rdb.Prefix + "fraud:" }
func (f *fixture) keys() fraud.Keys {
	return fraud.Keys{Prefix: f.keyPrefix(), Partitions: f.partitions}
}

func (f *fixture) relayConfig(name string) relay.Config {
	// OUTBOX_RELAY_OWNERSHIP=partitions runs the relay tests with
	// partition leases (`make test-partitions`); the tests of row claims
	// themselves set Ownership.
	return relay.Config{Name: name, StreamPrefix: f.streamPrefix(), PollInterval: 10 * time.Minute,
		Ownership: os.Getenv("OUTBOX_RELAY_OWNERSHIP")}
}

// rowsRelayConfig is relayConfig for the tests of row claims themselves
// (claimed_by, claim tokens, the reaper): Ownership OwnRows, whatever
// OUTBOX_RELAY_OWNERSHIP says.
func (f *fixture) rowsRelayConfig(name string) relay.Config {
	cfg := f.relayConfig(name)
	cfg.Ownership = relay.OwnRows
	return cfg
}

func (f *fixture) newRelay(cfg relay.Config, rdb relay.Pipeliner) *relay.Relay {
	f.t.Helper()
	if rdb == nil {
		rdb = f.rdb.Client
	}
	r, err := relay.New(f.pool, rdb, cfg)
	if err != nil {
		f.t.Fatal(err)
	}
	return r
}

func (f *fixture) newRelayWithPool(pool *pgxpool.Pool, cfg relay.Config) *relay.Relay {
	f.t.Helper()
	r, err := relay.New(pool, f.rdb.Client, cfg)
	if err != nil {
		f.t.Fatal(err)
	}
	return r
}

// drainInBackground drains one batch with r in a goroutine and delivers its
// result.
func (f *fixture) drainInBackground(r *relay.Relay) <-chan relay.BatchResult {
	done := make(chan relay.BatchResult, 1)
	go func() {
		res, err := r.DrainBatch(f.ctx)
		if err != nil {
			f.t.Errorf("drain: %v", err)
		}
		done <- res
	}()
	return done
}

// drainAll drains batches with r until one finds nothing, and returns the
// rows published. (With partition leases a batch takes one event per
// partition key, so a few TEDs of one sender take several batches.)
func (f *fixture) drainAll(r *relay.Relay) int {
	f.t.Helper()
	published := 0
	for {
		res, err := r.DrainBatch(f.ctx)
		if err != nil {
			f.t.Fatal(err)
		}
		published += res.Published
		if res.Claimed == 0 {
			return published
		}
	}
}

// run runs fn in the background until the test ends or stop is called.
func (f *fixture) run(fn func(context.Context) error) (stop func()) {
	ctx, cancel := context.WithCancel(f.ctx)
	done := make(chan error, 1)
	go func() { done <- fn(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					f.t.Errorf("background run: %v", err)
				}
			case <-time.After(15 * time.Second):
				f.t.Errorf("background run did not stop within 15s")
			}
		})
	}
	f.t.Cleanup(stop)
	return stop
}

func (f *fixture) consumer(name string, mutate func(*fraud.Config)) *fraud.Consumer {
	f.t.Helper()
	cfg := fraud.Config{
		Stream: f.stream(), KeyPrefix: f.keyPrefix(), Consumer: name,
		Block: 100 * time.Millisecond, ClaimInterval: 100 * time.Millisecond, ClaimMinIdle: 500 * time.Millisecond,
	}
	if mutate != nil {
		mutate(&cfg)
	}
	c, err := fraud.New(f.rdb.Client, cfg)
	if err != nil {
		f.t.Fatal(err)
	}
	return c
}

// settle settles n TEDs, each from a sender of its own: a sender's TEDs are
// published one at a time (the claim's gate), and the tests count on one
// batch taking them all.
func (f *fixture) settle(n int) []transfer.Transfer {
	f.t.Helper()
	out := make([]transfer.Transfer, n)
	for i := range out {
		out[i] = transfer.Transfer{
			ID:          uuid.New(),
			FromAccount: fmt.Sprintf("acct-%03d", i),
			ToAccount:   fmt.Sprintf("acct-%02d", 7+i%5),
			AmountCents: int64(100 + i),
		}
		if _, err := transfer.Settle(f.ctx, f.pool, out[i]); err != nil {
			f.t.Fatal(err)
		}
	}
	return out
}

func (f *fixture) count(query string, args ...any) int {
	f.t.Helper()
	var n int
	if err := f.pool.QueryRow(f.ctx, query, args...).Scan(&n); err != nil {
		f.t.Fatalf("%s: %v", query, err)
	}
	return n
}

// entries returns the event ids in the stream, in stream order.
func (f *fixture) entries(stream string) []string {
	f.t.Helper()
	msgs, err := f.rdb.XRange(f.ctx, stream, "-", "+").Result()
	if err != nil {
		f.t.Fatal(err)
	}
	ids := make([]string, len(msgs))
	for i, m := range msgs {
		ids[i], _ = m.Values["event_id"].(string)
	}
	return ids
}

func (f *fixture) report() fraud.Report {
	f.t.Helper()
	rep, err := fraud.ReadReport(f.ctx, f.rdb.Client, f.keys())
	if err != nil {
		f.t.Fatal(err)
	}
	return rep
}

// settled reads every settled transfer, in commit order (the seq of its
// event: settled_at is when each transaction began, and a sender's later
// writer may begin first).
func (f *fixture) settled() []transfer.Transfer {
	f.t.Helper()
	rows, err := f.pool.Query(f.ctx, `SELECT t.id, t.from_account, t.to_account, t.amount_cents
		FROM transfers t JOIN outbox_messages o ON o.aggregate_id = t.id::text ORDER BY o.seq`)
	if err != nil {
		f.t.Fatal(err)
	}
	teds, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (transfer.Transfer, error) {
		var t transfer.Transfer
		return t, r.Scan(&t.ID, &t.FromAccount, &t.ToAccount, &t.AmountCents)
	})
	if err != nil {
		f.t.Fatal(err)
	}
	return teds
}

// senderTotals sums the TEDs per sender, as anti-fraud's report should.
func senderTotals(teds []transfer.Transfer) map[string]fraud.AccountTotals {
	want := map[string]fraud.AccountTotals{}
	for _, t := range teds {
		a := want[t.FromAccount]
		a.SentCents += t.AmountCents
		a.Transfers++
		want[t.FromAccount] = a
	}
	return want
}

// checkEffectsOnce asserts anti-fraud holds exactly one verdict per transfer
// and totals equal to the sums over the transfers table.
func (f *fixture) checkEffectsOnce(teds []transfer.Transfer) {
	f.t.Helper()
	rep := f.report()
	if rep.Verdicts != int64(len(teds)) {
		f.t.Errorf("verdicts = %d, want %d (one per transfer)", rep.Verdicts, len(teds))
	}
	want := senderTotals(teds)
	for acct, w := range want {
		if got := rep.Accounts[acct]; got != w {
			f.t.Errorf("account %s totals = %+v, want %+v", acct, got, w)
		}
	}
	for _, t := range teds {
		v, err := fraud.Verdict(f.ctx, f.rdb.Client, f.keys(), t.ID.String())
		if err != nil || v == "" {
			f.t.Errorf("transfer %s has no verdict (err %v)", t.ID, err)
		}
	}
}

// outboxCmd runs the real binary against this fixture's servers.
func (f *fixture) outboxCmd(failpoint string, args ...string) *exec.Cmd {
	cmd := exec.Command(outboxtest.Binary(f.t), args...)
	cmd.Env = append(os.Environ(), "DATABASE_URL="+f.dbURL, "REDIS_URL="+f.rdb.URL, "OUTBOX_FAILPOINT="+failpoint)
	return cmd
}

// runUntilKilled runs cmd and expects the armed fail point to SIGKILL it.
func (f *fixture) runUntilKilled(cmd *exec.Cmd) {
	f.t.Helper()
	out, err := runWithTimeout(cmd, 30*time.Second)
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		f.t.Fatalf("%v: want death by SIGKILL at the fail point, got %v\n%s", cmd.Args, err, out)
	}
}

func runWithTimeout(cmd *exec.Cmd, d time.Duration) ([]byte, error) {
	var buf syncBuffer
	cmd.Stdout, cmd.Stderr = &buf, &buf
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		return buf.Bytes(), err
	case <-time.After(d):
		_ = cmd.Process.Kill()
		<-done
		return buf.Bytes(), fmt.Errorf("still running after %s", d)
	}
}

// freeAddr returns a loopback address with a port free right now.
func freeAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

type syncBuffer struct {
	mu sync.Mutex
	b  []byte
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.b = append(s.b, p...)
	return len(p), nil
}

func (s *syncBuffer) Bytes() []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.b)
}

// --- NOTIFY ---------------------------------------------------------------

// With the fallback poll at ten minutes, only NOTIFY can bring the relay to a
// newly committed event quickly.
func TestNotifyWakesRelay(t *testing.T) {
	f := newFixture(t)
	r := f.newRelay(f.relayConfig("r1"), nil)
	f.run(r.Run)
	outboxtest.Eventually(t, 5*time.Second, func() bool { return r.Stats().ListenUp }, "relay never LISTENed")
	time.Sleep(50 * time.Millisecond) // let the start-up drain finish

	for i := range 5 {
		// Writers notify only while the relay sleeps (migration 0006).
		outboxtest.Eventually(t, 5*time.Second, func() bool { return f.idleFlag() == 1 }, "relay never went to sleep")
		teds := f.settle(1)
		committed := time.Now()
		outboxtest.Eventually(t, 5*time.Second, func() bool {
			return f.count("SELECT count(*) FROM outbox_messages WHERE aggregate_id = $1 AND status = 'published'", teds[0].ID.String()) == 1
		}, "event %d not published; the relay was not woken by NOTIFY", i)
		t.Logf("event %d published %.2f ms after commit", i, float64(time.Since(committed).Microseconds())/1000)
	}
	if got := len(f.entries(f.stream())); got != 5 {
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
	f := newFixture(t)
	if _, err := f.pool.Exec(f.ctx, "DROP TRIGGER outbox_messages_notify ON outbox_messages"); err != nil {
		t.Fatal(err)
	}
	cfg := f.relayConfig("r1")
	cfg.PollInterval = 100 * time.Millisecond
	r := f.newRelay(cfg, nil)
	f.run(r.Run)
	// Commit only after the start-up drain and the wake-up that follows the
	// first LISTEN have both been consumed, so that only a poll can find the
	// rows: wait for the listener, then for two polls after it (the drain
	// loop may pick a ready poll tick before a pending wake-up).
	outboxtest.Eventually(t, 10*time.Second, func() bool { return r.Stats().ListenUp }, "relay never LISTENed")
	polls := r.Stats().Polls
	outboxtest.Eventually(t, 5*time.Second, func() bool { return r.Stats().Polls >= polls+2 }, "relay never polled")
	f.settle(20)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 20
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
	f := newFixture(t)
	r := f.newRelay(f.relayConfig("r1"), nil)
	f.run(r.Run)
	outboxtest.Eventually(t, 5*time.Second, func() bool { return r.Stats().ListenUp }, "relay never LISTENed")

	listeners := func() int {
		return f.count(`SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND application_name = 'outbox-test-listen'`)
	}
	for round := range 3 {
		outboxtest.Eventually(t, 10*time.Second, func() bool { return r.Stats().ListenUp && listeners() == 1 },
			"round %d: relay not LISTENing", round)
		// Kill the listener and commit events before it can come back.
		tx, err := f.pool.Begin(f.ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(f.ctx) }() // a no-op once committed; frees the connection on failure
		var killed int
		if err := tx.QueryRow(f.ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
			WHERE datname = current_database() AND application_name = 'outbox-test-listen'`).Scan(&killed); err != nil {
			t.Fatal(err)
		}
		if killed != 1 {
			t.Fatalf("round %d: terminated %d listen connections, want 1", round, killed)
		}
		for range 10 {
			if _, err := transfer.SettleTx(f.ctx, tx, transfer.Transfer{ID: uuid.New(), FromAccount: "a", ToAccount: "b", AmountCents: 1}); err != nil {
				t.Fatal(err)
			}
		}
		if err := tx.Commit(f.ctx); err != nil {
			t.Fatal(err)
		}
		outboxtest.Eventually(t, 10*time.Second, func() bool {
			return f.count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 10*(round+1)
		}, "round %d: events committed while the listener was down were not caught up", round)
	}
	if st := r.Stats(); st.Polls != 0 {
		t.Fatalf("stats %+v: caught up by the fallback poll, not by the reconnect", st)
	}
}

// --- Lease, reaper, fencing -------------------------------------------------

// A relay that dies right after claiming leaves its rows publishing; after
// the lease the reaper returns them and another relay publishes them.
func TestAbandonedClaimIsReapedAndPublished(t *testing.T) {
	f := newFixture(t)
	teds := f.settle(30)
	f.runUntilKilled(f.outboxCmd("relay.after-claim", "relay", "--ownership", "rows", "--stream-prefix", f.streamPrefix(), "--batch", "100", "--lease", "1s"))

	if n := f.count("SELECT count(*) FROM outbox_messages WHERE status = 'publishing' AND claim_token IS NOT NULL"); n != 30 {
		t.Fatalf("%d rows publishing after the crash, want 30", n)
	}
	if got := len(f.entries(f.stream())); got != 0 {
		t.Fatalf("stream holds %d entries, want 0 (the relay died before XADD)", got)
	}

	cfg := f.rowsRelayConfig("r2")
	cfg.Lease, cfg.ReapInterval = time.Second, 100*time.Millisecond
	r := f.newRelay(cfg, nil)
	f.run(r.Run)
	outboxtest.Eventually(t, 15*time.Second, func() bool {
		return f.count("SELECT count(*) FROM outbox_messages WHERE status = 'published' AND claimed_by = 'r2'") == 30
	}, "abandoned rows were not reaped and published")
	if r.Stats().Reaped != 30 {
		t.Fatalf("reaped %d, want 30", r.Stats().Reaped)
	}
	if got := len(f.entries(f.stream())); got != 30 {
		t.Fatalf("stream holds %d entries, want 30", got)
	}
	if n := f.count("SELECT count(*) FROM outbox_messages WHERE attempts = 1 AND last_error IS NULL"); n != 30 {
		t.Fatalf("%d rows count the expired lease as one attempt with the error cleared after publishing, want 30", n)
	}
	c := f.consumer("c1", nil)
	f.run(c.Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return f.report().Verdicts == 30 }, "not all events judged")
	f.checkEffectsOnce(teds)
}

// stallingRedis publishes for real, then blocks until released: a relay that
// stalls (GC pause, network) after XADD and before its mark.
type stallingRedis struct {
	*redis.Client
	published chan struct{}
	release   chan struct{}
}

func (s *stallingRedis) Pipelined(ctx context.Context, fn func(redis.Pipeliner) error) ([]redis.Cmder, error) {
	cmds, err := s.Client.Pipelined(ctx, fn)
	close(s.published)
	<-s.release
	return cmds, err
}

// A relay whose lease expired must not overwrite the newer claim: while
// another relay holds the row, the stale relay's late mark changes nothing;
// the duplicate it published is skipped downstream.
func TestStaleRelayIsFenced(t *testing.T) {
	f := newFixture(t)
	teds := f.settle(10)

	stallA := &stallingRedis{Client: f.rdb.Client, published: make(chan struct{}), release: make(chan struct{})}
	a := f.newRelay(f.rowsRelayConfig("relay-a"), stallA)
	resA := f.drainInBackground(a)
	<-stallA.published // A published and is now stuck before marking

	// A's lease runs out (aged on the database clock, no sleeping).
	if _, err := f.pool.Exec(f.ctx, "UPDATE outbox_messages SET claimed_at = claimed_at - interval '1 hour' WHERE status = 'publishing'"); err != nil {
		t.Fatal(err)
	}
	stallB := &stallingRedis{Client: f.rdb.Client, published: make(chan struct{}), release: make(chan struct{})}
	b := f.newRelay(f.rowsRelayConfig("relay-b"), stallB)
	if n, err := b.Reap(f.ctx); err != nil || n != 10 {
		t.Fatalf("reaped %d (err %v), want 10", n, err)
	}
	resB := f.drainInBackground(b)
	<-stallB.published // B re-claimed and published; it has not marked yet

	close(stallA.release)
	if res := <-resA; res.Published != 0 || res.Fenced != 10 {
		t.Fatalf("stale relay A: %+v, want 0 published and 10 fenced", res)
	}
	if n := f.count("SELECT count(*) FROM outbox_messages WHERE status = 'publishing' AND claimed_by = 'relay-b'"); n != 10 {
		t.Fatalf("%d rows still claimed by relay B after A's late mark, want 10", n)
	}

	close(stallB.release)
	if res := <-resB; res.Published != 10 || res.Fenced != 0 {
		t.Fatalf("relay B: %+v, want 10 published", res)
	}
	if got := len(f.entries(f.stream())); got != 20 {
		t.Fatalf("stream holds %d entries, want 20 (each event twice)", got)
	}
	c := f.consumer("c1", nil)
	f.run(c.Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return f.report().DuplicatesSkipped == 10 }, "duplicates not skipped")
	f.checkEffectsOnce(teds)
}

// --- Several relays ---------------------------------------------------------

// countingRedis records every event id it publishes.
type countingRedis struct {
	*redis.Client
	mu   sync.Mutex
	seen map[string]int
}

func (c *countingRedis) Pipelined(ctx context.Context, fn func(redis.Pipeliner) error) ([]redis.Cmder, error) {
	return c.Client.Pipelined(ctx, func(p redis.Pipeliner) error {
		return fn(countingPipe{Pipeliner: p, c: c})
	})
}

type countingPipe struct {
	redis.Pipeliner
	c *countingRedis
}

func (p countingPipe) XAdd(ctx context.Context, a *redis.XAddArgs) *redis.StringCmd {
	p.c.mu.Lock()
	p.c.seen[a.Values.([]any)[1].(string)]++
	p.c.mu.Unlock()
	return p.Pipeliner.XAdd(ctx, a)
}

// Four relays drain one backlog concurrently: every event is published
// exactly once, and no claim takes more than a batch.
func TestRelaysDrainDisjointRows(t *testing.T) {
	f := newFixture(t)
	const n, batch = 2000, 25
	msgs := make([]outbox.Message, n)
	for i := range msgs {
		msgs[i] = outbox.Message{AggregateType: "transfer", AggregateID: uuid.NewString(), EventType: "test.event", Payload: []byte(`{}`)}
	}
	if err := pgx.BeginFunc(f.ctx, f.pool, func(tx pgx.Tx) error { _, err := outbox.Write(f.ctx, tx, msgs...); return err }); err != nil {
		t.Fatal(err)
	}

	counter := &countingRedis{Client: f.rdb.Client, seen: map[string]int{}}
	var wg sync.WaitGroup
	var maxClaim, published, fenced int
	var mu sync.Mutex
	for i := range 4 {
		cfg := f.rowsRelayConfig(fmt.Sprintf("r%d", i))
		cfg.BatchSize = batch
		r := f.newRelay(cfg, counter)
		wg.Go(func() {
			for {
				res, err := r.DrainBatch(f.ctx)
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				maxClaim, published, fenced = max(maxClaim, res.Claimed), published+res.Published, fenced+res.Fenced
				mu.Unlock()
				if res.Claimed == 0 {
					return
				}
			}
		})
	}
	wg.Wait()
	if maxClaim > batch {
		t.Fatalf("a claim took %d rows, batch is %d", maxClaim, batch)
	}
	if published != n || fenced != 0 {
		t.Fatalf("published %d fenced %d, want %d and 0", published, fenced, n)
	}
	if len(counter.seen) != n {
		t.Fatalf("%d distinct events published, want %d", len(counter.seen), n)
	}
	for id, c := range counter.seen {
		if c != 1 {
			t.Fatalf("event %s published %d times: claimed by two relays at once", id, c)
		}
	}
	if got := f.count("SELECT count(DISTINCT claimed_by) FROM outbox_messages"); got < 2 {
		t.Fatalf("only %d relay did the work; the test did not exercise concurrency", got)
	}
}

// flakyRedis fails a share of XADDs (as a per-event error) and delays the
// others a little, to shake the interleaving of relays.
type flakyRedis struct {
	*redis.Client
	failRate float64
}

func (c *flakyRedis) Pipelined(ctx context.Context, fn func(redis.Pipeliner) error) ([]redis.Cmder, error) {
	time.Sleep(time.Duration(rand.IntN(3)) * time.Millisecond)
	return c.Client.Pipelined(ctx, func(p redis.Pipeliner) error {
		return fn(flakyPipe{Pipeliner: p, failRate: c.failRate})
	})
}

type flakyPipe struct {
	redis.Pipeliner
	failRate float64
}

func (p flakyPipe) XAdd(ctx context.Context, a *redis.XAddArgs) *redis.StringCmd {
	if rand.Float64() < p.failRate {
		return redis.NewStringResult("", errors.New("ERR injected failure"))
	}
	return p.Pipeliner.XAdd(ctx, a)
}

// publishThroughFlakyRelays runs four relays with the given partitions,
// small batches and fast backoff through a Redis that fails 30 % of the
// XADDs, until all total events are published, and checks that some publish
// did fail (so that retries were exercised).
func (f *fixture) publishThroughFlakyRelays(partitions, total int) {
	f.t.Helper()
	flaky := &flakyRedis{Client: f.rdb.Client, failRate: 0.3}
	for i := range 4 {
		cfg := f.relayConfig(fmt.Sprintf("r%d", i))
		cfg.Partitions = partitions
		cfg.BatchSize = 7
		cfg.PollInterval = 5 * time.Millisecond
		cfg.BackoffBase, cfg.BackoffMax, cfg.MaxAttempts = time.Millisecond, 20*time.Millisecond, 1000
		f.run(f.newRelay(cfg, flaky).Run)
	}
	outboxtest.Eventually(f.t, 60*time.Second, func() bool {
		return f.count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == total
	}, "not every event was published")
	if n := f.count("SELECT count(*) FROM outbox_messages WHERE attempts > 0"); n == 0 {
		f.t.Fatal("no publish failed; the test did not exercise retries")
	}
}

// Events of one aggregate reach the stream in the order they were written,
// with four relays, random publish failures and backoff in between.
func TestPerAggregateOrderSurvivesFailuresAndRelays(t *testing.T) {
	f := newFixture(t)
	const aggregates, perAggregate = 20, 25
	f.writeInterleaved(aggregates, perAggregate)
	f.publishThroughFlakyRelays(1, aggregates*perAggregate)
	f.checkInterleavedOrder(aggregates, perAggregate)
}

// writeInterleaved writes perKey events for each of keys aggregates
// (acct-00, acct-01...), interleaved over perKey transactions; event i of an
// aggregate has payload {"n": i}.
func (f *fixture) writeInterleaved(keys, perKey int) {
	f.t.Helper()
	for i := range perKey {
		err := pgx.BeginFunc(f.ctx, f.pool, func(tx pgx.Tx) error {
			msgs := make([]outbox.Message, keys)
			for a := range msgs {
				msgs[a] = outbox.Message{
					AggregateType: "account", AggregateID: fmt.Sprintf("acct-%02d", a),
					EventType: "account.changed", Payload: []byte(fmt.Sprintf(`{"n":%d}`, i)),
				}
			}
			_, err := outbox.Write(f.ctx, tx, msgs...)
			return err
		})
		if err != nil {
			f.t.Fatal(err)
		}
	}
}

// checkInterleavedOrder checks that the account stream holds writeInterleaved's
// events once each, every aggregate's in the order written.
func (f *fixture) checkInterleavedOrder(keys, perKey int) {
	f.t.Helper()
	msgs, err := f.rdb.XRange(f.ctx, f.streamPrefix()+"account", "-", "+").Result()
	if err != nil {
		f.t.Fatal(err)
	}
	if len(msgs) != keys*perKey {
		f.t.Fatalf("stream holds %d entries, want %d", len(msgs), keys*perKey)
	}
	next := map[string]int{}
	for _, m := range msgs {
		agg := m.Values["aggregate_id"].(string)
		var p struct{ N int }
		if err := json.Unmarshal([]byte(m.Values["payload"].(string)), &p); err != nil {
			f.t.Fatal(err)
		}
		if p.N != next[agg] {
			f.t.Fatalf("aggregate %s: got event %d, want %d (out of order)", agg, p.N, next[agg])
		}
		next[agg]++
	}
}

// An event that keeps failing backs off, ends dead after MaxAttempts with its
// error kept, and never holds up other aggregates.
func TestFailingEventGoesDeadWithoutBlockingOthers(t *testing.T) {
	f := newFixture(t)
	// A string key where the "poison" aggregate's stream should be: every XADD
	// to it fails with WRONGTYPE, a per-event error.
	if err := f.rdb.Set(f.ctx, f.streamPrefix()+"poison", "not a stream", 0).Err(); err != nil {
		t.Fatal(err)
	}
	err := pgx.BeginFunc(f.ctx, f.pool, func(tx pgx.Tx) error {
		_, err := outbox.Write(f.ctx, tx, outbox.Message{AggregateType: "poison", AggregateID: "p1", EventType: "x", Payload: []byte(`{}`)})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	teds := f.settle(5)

	cfg := f.relayConfig("r1")
	cfg.PollInterval, cfg.MaxAttempts = 5*time.Millisecond, 4
	cfg.BackoffBase, cfg.BackoffMax = 10*time.Millisecond, 40*time.Millisecond
	var logs syncBuffer
	cfg.Logger = slog.New(slog.NewJSONHandler(&logs, nil))
	r := f.newRelay(cfg, nil)
	f.run(r.Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.count("SELECT count(*) FROM outbox_messages WHERE aggregate_type = 'poison' AND status = 'dead'") == 1
	}, "poison event never went dead")
	// The death is an ERROR that names the event and says why (logged once
	// the row's death is committed, so it may come a moment after).
	var deaths []map[string]any
	outboxtest.Eventually(t, 5*time.Second, func() bool {
		deaths = nil
		for _, line := range bytes.Split(logs.Bytes(), []byte("\n")) {
			var rec map[string]any
			if json.Unmarshal(line, &rec) == nil && rec["level"] == "ERROR" {
				deaths = append(deaths, rec)
			}
		}
		return len(deaths) > 0
	}, "the death of the poison event was never logged at ERROR")
	var poisonID string
	if err := f.pool.QueryRow(f.ctx, "SELECT id::text FROM outbox_messages WHERE aggregate_type = 'poison'").Scan(&poisonID); err != nil {
		t.Fatal(err)
	}
	if len(deaths) != 1 || deaths[0]["event_id"] != poisonID || deaths[0]["aggregate_type"] != "poison" ||
		deaths[0]["aggregate_id"] != "p1" || deaths[0]["event_type"] != "x" || deaths[0]["attempts"] != float64(4) ||
		deaths[0]["max_attempts"] != float64(4) || !strings.Contains(fmt.Sprint(deaths[0]["last_error"]), "WRONGTYPE") {
		t.Fatalf("want one ERROR naming the dead event %s with its attempts and last error; got %v", poisonID, deaths)
	}
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.count("SELECT count(*) FROM outbox_messages WHERE aggregate_type = 'transfer' AND status = 'published'") == len(teds)
	}, "transfer events not all published next to a poison event")
	var attempts int
	var lastErr string
	var spread float64
	if err := f.pool.QueryRow(f.ctx, `SELECT attempts, last_error, extract(epoch FROM next_attempt_at - created_at)
		FROM outbox_messages WHERE aggregate_type = 'poison'`).Scan(&attempts, &lastErr, &spread); err != nil {
		t.Fatal(err)
	}
	if attempts != 4 || lastErr == "" {
		t.Fatalf("dead row: attempts %d last_error %q, want 4 and the WRONGTYPE error", attempts, lastErr)
	}
	if spread < 0.015 { // 3 backoffs of at least 5, 10 and 20 ms
		t.Fatalf("retries spread over %.3fs: no backoff between attempts", spread)
	}
}

// While Redis refuses every write the relay gives rows back without burning
// their attempts, and publishes them once Redis answers again.
func TestBrokerOutageDoesNotBurnAttempts(t *testing.T) {
	f := newFixture(t)
	down := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: 100 * time.Millisecond})
	t.Cleanup(func() { _ = down.Close() })
	cfg := f.relayConfig("r1")
	cfg.MaxAttempts = 2
	r := f.newRelay(cfg, down)
	f.settle(3)
	for range 5 {
		res, err := r.DrainBatch(f.ctx)
		if err != nil {
			t.Fatal(err)
		}
		if res.Claimed > 0 && (!res.BrokerDown || res.Released != res.Claimed) {
			t.Fatalf("batch %+v: want every row released as broker down", res)
		}
		if _, err := f.pool.Exec(f.ctx, "UPDATE outbox_messages SET next_attempt_at = now()"); err != nil {
			t.Fatal(err)
		}
	}
	released := "last_error LIKE 'released:%'" // row claims give the rows back
	if cfg.Ownership == relay.OwnPartitions {
		released = "claim_token IS NULL" // partition owners only read them
	}
	if n := f.count("SELECT count(*) FROM outbox_messages WHERE status = 'pending' AND attempts = 0 AND " + released); n != 3 {
		t.Fatalf("%d rows pending with no attempt spent, want 3", n)
	}
	// Another relay takes over (with partition leases, once the first
	// relay's leases have run out: aged on the database clock).
	f.expireRelayLeases()
	if n := f.drainAll(f.newRelay(cfg, nil)); n != 3 {
		t.Fatalf("after the outage: %d published, want 3", n)
	}
}

// --- Anti-fraud ---------------------------------------------------------------

// A crash between XADD and the mark republishes the events; anti-fraud
// applies each once.
func TestCrashAfterPublishBeforeMarkAppliesEffectOnce(t *testing.T) {
	f := newFixture(t)
	teds := f.settle(8)
	f.runUntilKilled(f.outboxCmd("relay.after-xadd", "relay", "--ownership", "rows", "--stream-prefix", f.streamPrefix(), "--lease", "1s"))
	if got := len(f.entries(f.stream())); got != 8 {
		t.Fatalf("stream holds %d entries after the crash, want 8", got)
	}
	if n := f.count("SELECT count(*) FROM outbox_messages WHERE status = 'publishing'"); n != 8 {
		t.Fatalf("%d rows publishing after the crash, want 8 (never marked)", n)
	}

	cfg := f.rowsRelayConfig("r2")
	cfg.Lease, cfg.ReapInterval = time.Second, 100*time.Millisecond
	f.run(f.newRelay(cfg, nil).Run)
	outboxtest.Eventually(t, 15*time.Second, func() bool {
		return f.count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 8
	}, "rows not republished after the lease")
	if got := len(f.entries(f.stream())); got != 16 {
		t.Fatalf("stream holds %d entries, want 16 (each event twice)", got)
	}

	f.run(f.consumer("c1", nil).Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		rep := f.report()
		return rep.Verdicts+rep.DuplicatesSkipped == 16
	}, "not every delivery was handled")
	if rep := f.report(); rep.DuplicatesSkipped != 8 {
		t.Fatalf("duplicates skipped %d, want 8", rep.DuplicatesSkipped)
	}
	f.checkEffectsOnce(teds)
}

// A consumer that dies after applying the effect and before XACK gets the
// entries back on restart (its pending list, read from id 0) and skips them.
func TestCrashAfterEffectBeforeAckAppliesEffectOnce(t *testing.T) {
	f := newFixture(t)
	teds := f.settle(6)
	if res, err := f.newRelay(f.relayConfig("r1"), nil).DrainBatch(f.ctx); err != nil || res.Published != 6 {
		t.Fatalf("publish: %+v %v", res, err)
	}
	f.runUntilKilled(f.outboxCmd("fraud.after-effect", "fraud", "--stream", f.stream(), "--key-prefix", f.keyPrefix(), "--consumer", "c1"))
	if rep := f.report(); rep.Verdicts != 6 {
		t.Fatalf("verdicts %d after the crash, want 6 (effect applied, not acked)", rep.Verdicts)
	}
	pending, err := f.rdb.XPending(f.ctx, f.stream(), fraud.DefaultGroup).Result()
	if err != nil || pending.Count != 6 {
		t.Fatalf("pending %+v (err %v), want 6 unacknowledged entries", pending, err)
	}

	// Restarted under the same name, with claiming of idle entries off: only
	// re-reading its own pending entries can bring them back.
	f.run(f.consumer("c1", func(c *fraud.Config) { c.ClaimInterval = time.Hour }).Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return f.report().DuplicatesSkipped == 6 },
		"pending entries were not re-read after the restart")
	// The XACK follows the script that counted the duplicate.
	outboxtest.Eventually(t, 5*time.Second, func() bool {
		pending, err := f.rdb.XPending(f.ctx, f.stream(), fraud.DefaultGroup).Result()
		return err == nil && pending.Count == 0
	}, "entries still pending after they were skipped")
	f.checkEffectsOnce(teds)
}

// Entries a dead consumer read but never acknowledged are claimed by a live
// one after ClaimMinIdle and applied once.
func TestDeadConsumersEntriesAreClaimed(t *testing.T) {
	f := newFixture(t)
	teds := f.settle(10)
	if _, err := f.newRelay(f.relayConfig("r1"), nil).DrainBatch(f.ctx); err != nil {
		t.Fatal(err)
	}
	// It holds the stream's partition: another consumer takes it over once
	// the lease expires.
	f.runUntilKilled(f.outboxCmd("fraud.after-read", "fraud", "--stream", f.stream(), "--key-prefix", f.keyPrefix(), "--consumer", "dead",
		"--block", "100ms", "--partition-lease", "1s"))
	if rep := f.report(); rep.Verdicts != 0 {
		t.Fatalf("verdicts %d, want 0 (died before the effect)", rep.Verdicts)
	}
	f.run(f.consumer("alive", func(c *fraud.Config) { c.ClaimMinIdle = 300 * time.Millisecond }).Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return f.report().Verdicts == 10 }, "dead consumer's entries not claimed")
	pend, err := f.rdb.XPendingExt(f.ctx, &redis.XPendingExtArgs{Stream: f.stream(), Group: fraud.DefaultGroup, Start: "-", End: "+", Count: 100}).Result()
	if err != nil || len(pend) != 0 {
		t.Fatalf("pending after claim: %v (err %v)", pend, err)
	}
	f.checkEffectsOnce(teds)
}

// The same event delivered twice, also to two consumers at once, has one
// effect.
func TestDuplicateDeliveryAppliesEffectOnce(t *testing.T) {
	f := newFixture(t)
	teds := f.settle(20)
	// Publish every event three times (three relays that each believe they own it).
	for range 3 {
		if _, err := f.pool.Exec(f.ctx, "UPDATE outbox_messages SET status = 'pending', claim_token = NULL, published_at = NULL"); err != nil {
			t.Fatal(err)
		}
		if res, err := f.newRelay(f.rowsRelayConfig("r"), nil).DrainBatch(f.ctx); err != nil || res.Published != 20 {
			t.Fatalf("publish: %+v %v", res, err)
		}
	}
	f.run(f.consumer("c1", nil).Run)
	f.run(f.consumer("c2", nil).Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		rep := f.report()
		return rep.Verdicts+rep.DuplicatesSkipped == 60
	}, "not every delivery was handled")
	if rep := f.report(); rep.DuplicatesSkipped != 40 {
		t.Fatalf("duplicates skipped %d, want 40", rep.DuplicatesSkipped)
	}
	f.checkEffectsOnce(teds)
}

// Entries anti-fraud cannot use go to the dead-letter stream after
// MaxDeliveries, acknowledged; valid events keep flowing.
func TestPoisonEntriesAreDeadLettered(t *testing.T) {
	f := newFixture(t)
	teds := f.settle(3)
	bad := [][]any{
		{"event_id", uuid.NewString(), "event_type", "transfer.settled", "payload", "not json"},
		{"event_id", uuid.NewString(), "event_type", "transfer.settled", "payload", `{"amount_cents":"ten"}`},
		{"event_id", uuid.NewString(), "event_type", "transfer.reversed", "payload", `{}`},
		{"payload", `{}`},
	}
	for _, v := range bad {
		if err := f.rdb.XAdd(f.ctx, &redis.XAddArgs{Stream: f.stream(), Values: v}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := f.newRelay(f.relayConfig("r1"), nil).DrainBatch(f.ctx); err != nil {
		t.Fatal(err)
	}
	c := f.consumer("c1", func(c *fraud.Config) { c.MaxDeliveries = 3; c.ClaimMinIdle = 50 * time.Millisecond })
	f.run(c.Run)
	outboxtest.Eventually(t, 15*time.Second, func() bool { return f.report().DeadLettered == 4 }, "poison entries not dead-lettered")
	dlq, err := f.rdb.XRange(f.ctx, f.keyPrefix()+"dlq", "-", "+").Result()
	if err != nil || len(dlq) != 4 {
		t.Fatalf("dead-letter stream holds %d entries (err %v), want 4", len(dlq), err)
	}
	for _, m := range dlq {
		if d, _ := strconv.Atoi(m.Values["dlq_deliveries"].(string)); d < 3 || m.Values["dlq_reason"] == "" {
			t.Fatalf("dead letter %v: want deliveries >= 3 and a reason", m.Values)
		}
	}
	if pending, _ := f.rdb.XPending(f.ctx, f.stream(), fraud.DefaultGroup).Result(); pending.Count != 0 {
		t.Fatalf("%d entries still pending", pending.Count)
	}
	f.checkEffectsOnce(teds)
}

// --- End to end through the real binary ---------------------------------------

// Every settled TED reaches anti-fraud through the real commands, and the
// report contract holds; SIGTERM stops relay and consumer with exit code 0.
func TestEndToEndWithCommands(t *testing.T) {
	f := newFixture(t)
	relayMetrics, fraudMetrics := freeAddr(t), freeAddr(t)
	relayCmd := f.outboxCmd("", "relay", "--stream-prefix", f.streamPrefix(), "--poll", "1m", "--metrics-addr", relayMetrics)
	fraudCmd := f.outboxCmd("", "fraud", "--stream", f.stream(), "--key-prefix", f.keyPrefix(), "--consumer", "c1",
		"--metrics-addr", fraudMetrics)
	var relayOut, fraudOut syncBuffer
	relayCmd.Stdout, relayCmd.Stderr = &relayOut, &relayOut
	fraudCmd.Stdout, fraudCmd.Stderr = &fraudOut, &fraudOut
	for _, c := range []*exec.Cmd{relayCmd, fraudCmd} {
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Process.Kill() })
	}

	out, err := f.outboxCmd("", "settle", "--count", "300", "--concurrency", "8", "--accounts", "12", "--json").CombinedOutput()
	if err != nil {
		t.Fatalf("settle: %v\n%s", err, out)
	}
	var sum struct{ Settled, Failed int }
	if err := json.Unmarshal(out, &sum); err != nil || sum.Settled != 300 || sum.Failed != 0 {
		t.Fatalf("settle summary %s (err %v)", out, err)
	}
	outboxtest.Eventually(t, 20*time.Second, func() bool { return f.report().Verdicts == 300 }, "not every TED judged")

	f.checkEffectsOnce(f.settled())
	if code, body := get(t, "http://"+relayMetrics+"/readyz"); code != 200 {
		t.Fatalf("relay /readyz: %d %s", code, body)
	}
	if got := scrape(t, "http://"+relayMetrics, "outbox_relay_published_total"); got != 300 {
		t.Fatalf("relay published_total %v, want 300", got)
	}
	if got := scrape(t, "http://"+fraudMetrics, "outbox_fraud_events_processed_total", "verdict", "approve") +
		scrape(t, "http://"+fraudMetrics, "outbox_fraud_events_processed_total", "verdict", "review"); got != 300 {
		t.Fatalf("fraud processed_total %v, want 300", got)
	}

	out, err = f.outboxCmd("", "fraud", "report", "--json", "--key-prefix", f.keyPrefix()).Output()
	if err != nil {
		t.Fatalf("fraud report: %v", err)
	}
	var rep map[string]json.RawMessage
	if err := json.Unmarshal(out, &rep); err != nil {
		t.Fatalf("fraud report output %s: %v", out, err)
	}
	for _, k := range []string{"verdicts", "reviews", "duplicates_skipped", "dead_lettered", "accounts"} {
		if _, ok := rep[k]; !ok {
			t.Fatalf("fraud report lacks %q: %s", k, out)
		}
	}
	out, err = f.outboxCmd("", "status", "--json", "--stream", f.stream()).Output()
	if err != nil {
		t.Fatalf("status: %v", err)
	}
	var raw map[string]any
	if err := json.Unmarshal(out, &raw); err != nil {
		t.Fatalf("status output %s: %v", out, err)
	}
	if raw["published"] != float64(300) || raw["pending"] != float64(0) || raw["stream_length"] != float64(300) || raw["group_pending"] != float64(0) {
		t.Fatalf("status %s", out)
	}

	for name, c := range map[string]*exec.Cmd{"relay": relayCmd, "fraud": fraudCmd} {
		start := time.Now()
		if err := c.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- c.Wait() }()
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("%s exited with %v after SIGTERM", name, err)
			}
			t.Logf("%s stopped %.0f ms after SIGTERM", name, float64(time.Since(start).Milliseconds()))
		case <-time.After(10 * time.Second):
			t.Fatalf("%s ignored SIGTERM for 10s", name)
		}
	}
}

// Publishing an event makes the next event of its aggregate claimable, and no
// NOTIFY announces that: the relay must keep draining, not wait for a poll.
func TestAggregateChainDrainsWithoutPolling(t *testing.T) {
	f := newFixture(t)
	r := f.newRelay(f.relayConfig("r1"), nil)
	f.run(r.Run)
	outboxtest.Eventually(t, 5*time.Second, func() bool { return r.Stats().ListenUp }, "relay never LISTENed")
	err := pgx.BeginFunc(f.ctx, f.pool, func(tx pgx.Tx) error {
		msgs := make([]outbox.Message, 5)
		for i := range msgs {
			msgs[i] = outbox.Message{AggregateType: "account", AggregateID: "acct-1", EventType: "account.changed", Payload: []byte(`{}`)}
		}
		_, err := outbox.Write(f.ctx, tx, msgs...)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	outboxtest.Eventually(t, 5*time.Second, func() bool {
		return f.count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 5
	}, "a chain of one aggregate's events waits for the (10 minute) fallback poll")
	if r.Stats().Polls != 0 {
		t.Fatal("drained by the fallback poll")
	}
}

// SKIP LOCKED: a row locked by someone else (another relay's claim in
// progress) does not make a claim wait; the claim takes the other rows.
func TestClaimSkipsLockedRows(t *testing.T) {
	f := newFixture(t)
	f.settle(5)
	tx, err := f.pool.Begin(f.ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(f.ctx) }()
	if _, err := tx.Exec(f.ctx, "SELECT id FROM outbox_messages ORDER BY seq LIMIT 1 FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(f.ctx, 5*time.Second)
	defer cancel()
	done := make(chan relay.BatchResult, 1)
	go func() {
		res, err := f.newRelay(f.rowsRelayConfig("r1"), nil).DrainBatch(ctx)
		if err != nil {
			t.Error(err)
		}
		done <- res
	}()
	select {
	case res := <-done:
		if res.Published != 4 {
			t.Fatalf("claim around a locked row: %+v, want the 4 other rows published", res)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("claim waited for a row lock held elsewhere: no SKIP LOCKED")
	}
}

// On shutdown the relay stops claiming but finishes the batch in flight, so
// nothing waits for a lease to expire.
func TestShutdownFinishesBatchInFlight(t *testing.T) {
	f := newFixture(t)
	f.settle(10)
	stall := &stallingRedis{Client: f.rdb.Client, published: make(chan struct{}), release: make(chan struct{})}
	r := f.newRelay(f.relayConfig("r1"), stall)
	ctx, cancel := context.WithCancel(f.ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	<-stall.published
	cancel() // SIGTERM arrives while the batch is between XADD and the mark
	time.AfterFunc(200*time.Millisecond, func() { close(stall.release) })
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("relay did not stop within 10s")
	}
	if n := f.count("SELECT count(*) FROM outbox_messages WHERE status = 'published'"); n != 10 {
		t.Fatalf("%d rows published, want 10: the batch in flight was abandoned", n)
	}
}

// A half-open LISTEN connection (no RST, no FIN: the peer just went silent) is
// noticed by the ping after a quiet poll interval and replaced.
func TestHalfOpenListenConnectionIsReplaced(t *testing.T) {
	f := newFixture(t)
	cfg := f.relayConfig("r1")
	listen, err := pgx.ParseConfig(f.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	proxy, err := tcpproxy.Start(fmt.Sprintf("%s:%d", listen.Host, listen.Port))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = proxy.Close() })
	viaProxy(&listen.Config, proxy)
	listen.RuntimeParams["application_name"] = "outbox-test-listen"
	cfg.ListenConfig = listen
	cfg.PollInterval = 500 * time.Millisecond
	r := f.newRelay(cfg, nil)
	f.run(r.Run)
	outboxtest.Eventually(t, 5*time.Second, func() bool { return r.Stats().ListenUp }, "relay never LISTENed")
	pidOf := func() int {
		var pid int
		_ = f.pool.QueryRow(f.ctx, `SELECT coalesce(max(pid), 0) FROM pg_stat_activity
			WHERE datname = current_database() AND application_name = 'outbox-test-listen'`).Scan(&pid)
		return pid
	}
	before := pidOf()
	proxy.Freeze()
	outboxtest.Eventually(t, 20*time.Second, func() bool { p := pidOf(); return p != 0 && p != before && r.Stats().ListenUp },
		"the half-open LISTEN connection was never replaced")
	n0 := r.Stats().Notifications
	f.settle(1)
	outboxtest.Eventually(t, 5*time.Second, func() bool { return r.Stats().Notifications > n0 },
		"no notification on the new LISTEN connection")
}

// An effect that fails for a reason that is not the entry's (here a key of
// the wrong type, as a stand-in for Redis refusing writes) is retried however
// often the entry is delivered, never dead-lettered, and applied once when
// the fault clears.
func TestTransientEffectFailureIsRetriedNotDeadLettered(t *testing.T) {
	f := newFixture(t)
	teds := f.settle(5)
	if _, err := f.newRelay(f.relayConfig("r1"), nil).DrainBatch(f.ctx); err != nil {
		t.Fatal(err)
	}
	alerts := f.keyPrefix() + "alerts"
	if err := f.rdb.Set(f.ctx, alerts, "in the way", 0).Err(); err != nil {
		t.Fatal(err)
	}
	c := f.consumer("c1", func(c *fraud.Config) {
		c.MaxDeliveries, c.ClaimMinIdle, c.ClaimInterval = 2, 20*time.Millisecond, 20*time.Millisecond
	})
	f.run(c.Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		pend, err := f.rdb.XPendingExt(f.ctx, &redis.XPendingExtArgs{Stream: f.stream(), Group: fraud.DefaultGroup, Start: "-", End: "+", Count: 10}).Result()
		return err == nil && len(pend) == 5 && pend[0].RetryCount > 3
	}, "entries were not redelivered past MaxDeliveries")
	if rep := f.report(); rep.DeadLettered != 0 || rep.Verdicts != 0 {
		t.Fatalf("report %+v: a transient failure dead-lettered or half-applied entries", rep)
	}
	if err := f.rdb.Del(f.ctx, alerts).Err(); err != nil {
		t.Fatal(err)
	}
	outboxtest.Eventually(t, 15*time.Second, func() bool { return f.report().Verdicts == 5 }, "entries not applied after the fault cleared")
	f.checkEffectsOnce(teds)
}

// Trimming caps the stream but never removes an entry a consumer group has
// not read, or read and not acknowledged: a lagging consumer loses nothing.
func TestTrimmingNeverLosesWhatALaggingConsumerNeeds(t *testing.T) {
	f := newFixture(t)
	if err := f.consumer("c1", nil).EnsureGroup(f.ctx); err != nil { // the group exists, but lags
		t.Fatal(err)
	}
	teds := f.settle(50)
	cfg := f.relayConfig("r1")
	cfg.StreamMaxLen = 10
	r := f.newRelay(cfg, nil)
	if res, err := r.DrainBatch(f.ctx); err != nil || res.Published != 50 {
		t.Fatalf("publish: %+v %v", res, err)
	}
	if n, err := r.TrimStream(f.ctx, f.rdb.Client, f.stream()); err != nil || n != 0 {
		t.Fatalf("trimmed %d (err %v) although the group has read nothing", n, err)
	}

	// The consumer processes (and acknowledges) 20; another reads 10 more
	// and dies before acknowledging them.
	c20 := f.consumer("c1", func(c *fraud.Config) { c.BatchSize = 20 })
	if n, err := c20.ReadNew(f.ctx); err != nil || n != 20 {
		t.Fatalf("processed %d (err %v), want 20", n, err)
	}
	res, err := f.rdb.XReadGroup(f.ctx, &redis.XReadGroupArgs{Group: fraud.DefaultGroup, Consumer: "c2",
		Streams: []string{f.stream(), ">"}, Count: 10, Block: -1}).Result()
	if err != nil || len(res[0].Messages) != 10 {
		t.Fatalf("read: %v", err)
	}
	unacked := res[0].Messages
	n, err := r.TrimStream(f.ctx, f.rdb.Client, f.stream())
	if err != nil || n != 20 {
		t.Fatalf("trimmed %d (err %v), want the 20 read and acknowledged entries", n, err)
	}
	if first, _ := f.rdb.XRangeN(f.ctx, f.stream(), "-", "+", 1).Result(); first[0].ID != unacked[0].ID {
		t.Fatalf("oldest entry is %s, want the oldest unacknowledged %s", first[0].ID, unacked[0].ID)
	}

	// The consumers catch up (c2's entries are claimed): every TED is
	// judged, none was lost.
	f.run(f.consumer("c1", func(c *fraud.Config) { c.ClaimMinIdle = 50 * time.Millisecond }).Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return f.report().Verdicts == 50 }, "a lagging consumer lost events to trimming")
	f.checkEffectsOnce(teds)
	// Once everything is acknowledged, the cap applies.
	if _, err := r.TrimStream(f.ctx, f.rdb.Client, f.stream()); err != nil {
		t.Fatal(err)
	}
	if n := f.rdb.XLen(f.ctx, f.stream()).Val(); n != 10 {
		t.Fatalf("stream length %d after catching up, want the cap of 10", n)
	}
}

// A stream nobody has created a group on yet is not trimmed: its consumers
// may simply not have started.
func TestTrimmingLeavesStreamsWithoutGroups(t *testing.T) {
	f := newFixture(t)
	f.settle(30)
	cfg := f.relayConfig("r1")
	cfg.StreamMaxLen = 5
	r := f.newRelay(cfg, nil)
	if _, err := r.DrainBatch(f.ctx); err != nil {
		t.Fatal(err)
	}
	if n, err := r.TrimStream(f.ctx, f.rdb.Client, f.stream()); err != nil || n != 0 {
		t.Fatalf("trimmed %d (err %v) from a stream with no consumer group", n, err)
	}
}

// A running relay trims the streams it publishes to on its own.
func TestRelayTrimsWhileRunning(t *testing.T) {
	f := newFixture(t)
	f.run(f.consumer("c1", nil).Run) // keeps up, so everything is acknowledged
	cfg := f.relayConfig("r1")
	cfg.StreamMaxLen, cfg.TrimInterval = 10, 50*time.Millisecond
	f.run(f.newRelay(cfg, nil).Run)
	f.settle(40)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return f.report().Verdicts == 40 }, "events not processed")
	outboxtest.Eventually(t, 10*time.Second, func() bool { return f.rdb.XLen(f.ctx, f.stream()).Val() == 10 },
		"the running relay never trimmed the stream to 10 entries")
}

// Retention-based trimming respects lagging groups too.
func TestRetentionTrimmingKeepsUnacknowledged(t *testing.T) {
	f := newFixture(t)
	if err := f.consumer("c1", nil).EnsureGroup(f.ctx); err != nil {
		t.Fatal(err)
	}
	f.settle(20)
	cfg := f.relayConfig("r1")
	cfg.StreamRetention = time.Millisecond // everything is "old"
	r := f.newRelay(cfg, nil)
	if _, err := r.DrainBatch(f.ctx); err != nil {
		t.Fatal(err)
	}
	if n, err := f.consumer("c1", func(c *fraud.Config) { c.BatchSize = 5 }).ReadNew(f.ctx); err != nil || n != 5 {
		t.Fatalf("processed %d (err %v)", n, err)
	}
	time.Sleep(5 * time.Millisecond)
	if n, err := r.TrimStream(f.ctx, f.rdb.Client, f.stream()); err != nil || n != 5 {
		t.Fatalf("trimmed %d (err %v), want only the 5 acknowledged entries", n, err)
	}
}

// viaProxy points cfg at the proxy, and every fallback pgx derived from the
// URL too: with sslmode=prefer (the default) a connection that fails is
// retried in plain text at the fallback's address, through which a new
// connection would bypass a proxy that is down.
func viaProxy(cfg *pgconn.Config, p *tcpproxy.Proxy) {
	cfg.Host, cfg.Port = "127.0.0.1", uint16(p.Port())
	for _, fb := range cfg.Fallbacks {
		fb.Host, fb.Port = cfg.Host, cfg.Port
	}
}
