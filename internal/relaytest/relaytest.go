// Package relaytest is the kit of the relay's integration tests, shared by
// the relay package's own tests (relay/*_test.go) and the end-to-end tests
// at the module root: a Fixture (one test's fresh database and Redis key
// prefix) with helpers to write events, run relays and look at the outcome,
// and Redis clients that stall, fail or count on purpose. Everything runs on
// real servers (internal/outboxtest finds them).
package relaytest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/transfer"
)

// Fixture is one test's database, Redis key prefix and helpers. Helpers fail
// the test on any error.
type Fixture struct {
	T     *testing.T
	Ctx   context.Context // cancelled when the test ends
	DBURL string          // the test's own migrated database
	Pool  *pgxpool.Pool   // to DBURL, 20 connections
	Redis outboxtest.Redis
}

// New returns a fixture on a fresh migrated database and a fresh Redis key
// prefix, both removed when the test ends.
func New(t *testing.T) *Fixture {
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
	return &Fixture{T: t, Ctx: ctx, DBURL: dbURL, Pool: pool, Redis: outboxtest.NewRedis(t)}
}

// StreamPrefix is the relays' stream prefix, under the test's key prefix.
func (f *Fixture) StreamPrefix() string { return f.Redis.Prefix + "outbox.event." }

// Stream is the stream of transfer events.
func (f *Fixture) Stream() string { return f.StreamPrefix() + "transfer" }

// RelayConfig is a relay of this fixture, polling only every ten minutes
// (so that a test passing in time proves the wake-up, not the poll). With
// OUTBOX_RELAY_OWNERSHIP=partitions (make test's second pass) the relay
// leases partitions; the tests of one ownership set Ownership themselves.
func (f *Fixture) RelayConfig(name string) relay.Config {
	return relay.Config{Name: name, StreamPrefix: f.StreamPrefix(), PollInterval: 10 * time.Minute,
		Ownership: os.Getenv("OUTBOX_RELAY_OWNERSHIP")}
}

// RowsRelayConfig is RelayConfig for the tests of row claims themselves
// (claimed_by, claim tokens, the reaper): Ownership OwnRows, whatever
// OUTBOX_RELAY_OWNERSHIP says.
func (f *Fixture) RowsRelayConfig(name string) relay.Config {
	cfg := f.RelayConfig(name)
	cfg.Ownership = relay.OwnRows
	return cfg
}

// PartitionRelayConfig is RelayConfig with partition leases.
func (f *Fixture) PartitionRelayConfig(name string) relay.Config {
	cfg := f.RelayConfig(name)
	cfg.Ownership = relay.OwnPartitions
	return cfg
}

// NewRelay returns a relay on the fixture's pool publishing to rdb (nil: the
// fixture's Redis).
func (f *Fixture) NewRelay(cfg relay.Config, rdb relay.Pipeliner) *relay.Relay {
	f.T.Helper()
	if rdb == nil {
		rdb = f.Redis.Client
	}
	r, err := relay.New(f.Pool, rdb, cfg)
	if err != nil {
		f.T.Fatal(err)
	}
	return r
}

// NewRelayWithPool returns a relay on pool publishing to the fixture's Redis.
func (f *Fixture) NewRelayWithPool(pool *pgxpool.Pool, cfg relay.Config) *relay.Relay {
	f.T.Helper()
	r, err := relay.New(pool, f.Redis.Client, cfg)
	if err != nil {
		f.T.Fatal(err)
	}
	return r
}

// DrainInBackground drains one batch with r in a goroutine and delivers its
// result.
func (f *Fixture) DrainInBackground(r *relay.Relay) <-chan relay.BatchResult {
	done := make(chan relay.BatchResult, 1)
	go func() {
		res, err := r.DrainBatch(f.Ctx)
		if err != nil {
			f.T.Errorf("drain: %v", err)
		}
		done <- res
	}()
	return done
}

// DrainAll drains batches with r until one finds nothing, and returns the
// rows published. (With partition leases a batch takes one event per
// partition key, so a few TEDs of one sender take several batches.)
func (f *Fixture) DrainAll(r *relay.Relay) int {
	f.T.Helper()
	published := 0
	for {
		res, err := r.DrainBatch(f.Ctx)
		if err != nil {
			f.T.Fatal(err)
		}
		published += res.Published
		if res.Claimed == 0 {
			return published
		}
	}
}

// Run runs fn in the background until the test ends or stop is called; fn
// must return nil when its context is cancelled, within 15s.
func (f *Fixture) Run(fn func(context.Context) error) (stop func()) {
	ctx, cancel := context.WithCancel(f.Ctx)
	done := make(chan error, 1)
	go func() { done <- fn(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					f.T.Errorf("background run: %v", err)
				}
			case <-time.After(15 * time.Second):
				f.T.Errorf("background run did not stop within 15s")
			}
		})
	}
	f.T.Cleanup(stop)
	return stop
}

// Settle settles n TEDs, each from a sender of its own: a sender's TEDs are
// published one at a time (the claim's gate), and the tests count on one
// batch taking them all.
func (f *Fixture) Settle(n int) []transfer.Transfer {
	f.T.Helper()
	out := make([]transfer.Transfer, n)
	for i := range out {
		out[i] = transfer.Transfer{
			ID:          uuid.New(),
			FromAccount: fmt.Sprintf("acct-%03d", i),
			ToAccount:   fmt.Sprintf("acct-%02d", 7+i%5),
			AmountCents: int64(100 + i),
		}
		if _, err := transfer.Settle(f.Ctx, f.Pool, out[i]); err != nil {
			f.T.Fatal(err)
		}
	}
	return out
}

// Count runs a query that returns one integer.
func (f *Fixture) Count(query string, args ...any) int {
	f.T.Helper()
	var n int
	if err := f.Pool.QueryRow(f.Ctx, query, args...).Scan(&n); err != nil {
		f.T.Fatalf("%s: %v", query, err)
	}
	return n
}

// Exec runs a statement.
func (f *Fixture) Exec(sql string, args ...any) {
	f.T.Helper()
	if _, err := f.Pool.Exec(f.Ctx, sql, args...); err != nil {
		f.T.Fatalf("%s: %v", sql, err)
	}
}

// PoolWith returns a pool to the fixture's database whose connections set
// params (e.g. default_transaction_isolation), closed when the test ends.
func (f *Fixture) PoolWith(params map[string]string) *pgxpool.Pool {
	f.T.Helper()
	cfg, err := pgxpool.ParseConfig(f.DBURL)
	if err != nil {
		f.T.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = "outbox-test"
	for k, v := range params {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	pool, err := pgxpool.NewWithConfig(f.Ctx, cfg)
	if err != nil {
		f.T.Fatal(err)
	}
	f.T.Cleanup(pool.Close)
	return pool
}

// Entries returns the event ids in the stream, in stream order.
func (f *Fixture) Entries(stream string) []string {
	f.T.Helper()
	msgs, err := f.Redis.XRange(f.Ctx, stream, "-", "+").Result()
	if err != nil {
		f.T.Fatal(err)
	}
	ids := make([]string, len(msgs))
	for i, m := range msgs {
		ids[i], _ = m.Values["event_id"].(string)
	}
	return ids
}

// IdleFlag is the wake-up protocol's flag: 1 while writers notify.
func (f *Fixture) IdleFlag() int {
	f.T.Helper()
	var v int
	ctx, cancel := context.WithTimeout(f.Ctx, 5*time.Second)
	defer cancel()
	if err := f.Pool.QueryRow(ctx, "SELECT last_value FROM outbox_relay_idle").Scan(&v); err != nil {
		f.T.Fatal(err)
	}
	return v
}

// Held is how many partition slots each relay holds.
type Held map[string]int

// Total is the number of slots held.
func (h Held) Total() int {
	n := 0
	for _, v := range h {
		n += v
	}
	return n
}

// Each reports whether every relay holds want slots.
func (h Held) Each(want int) bool {
	for _, v := range h {
		if v != want {
			return false
		}
	}
	return true
}

// LeaseHolders returns how many partition slots each relay holds with a live
// lease.
func (f *Fixture) LeaseHolders() Held {
	f.T.Helper()
	rows, err := f.Pool.Query(f.Ctx, `SELECT owner, count(*)::int FROM outbox_relay_partitions
		WHERE owner IS NOT NULL AND lease_until > now() GROUP BY owner`)
	if err != nil {
		f.T.Fatal(err)
	}
	held := Held{}
	for rows.Next() {
		var owner string
		var n int
		if err := rows.Scan(&owner, &n); err != nil {
			f.T.Fatal(err)
		}
		held[owner] = n
	}
	if err := rows.Err(); err != nil {
		f.T.Fatal(err)
	}
	return held
}

// ExpireRelayLeases ages every relay's partition leases and membership past
// their end, on the database clock: the relays holding them are as good as
// dead to the others.
func (f *Fixture) ExpireRelayLeases() {
	f.T.Helper()
	f.Exec("UPDATE outbox_relay_partitions SET lease_until = now() - interval '1 second'")
	f.Exec("UPDATE outbox_relay_members SET seen_until = now() - interval '1 second'")
}

// WriteInterleaved writes perKey events for each of keys aggregates
// (acct-00, acct-01...), interleaved over perKey transactions; event i of an
// aggregate has payload {"n": i}.
func (f *Fixture) WriteInterleaved(keys, perKey int) {
	f.T.Helper()
	for i := range perKey {
		err := pgx.BeginFunc(f.Ctx, f.Pool, func(tx pgx.Tx) error {
			msgs := make([]outbox.Message, keys)
			for a := range msgs {
				msgs[a] = outbox.Message{
					AggregateType: "account", AggregateID: fmt.Sprintf("acct-%02d", a),
					EventType: "account.changed", Payload: []byte(fmt.Sprintf(`{"n":%d}`, i)),
				}
			}
			_, err := outbox.Write(f.Ctx, tx, msgs...)
			return err
		})
		if err != nil {
			f.T.Fatal(err)
		}
	}
}

// CheckInterleavedOrder checks that the account stream holds
// WriteInterleaved's events once each, every aggregate's in the order
// written.
func (f *Fixture) CheckInterleavedOrder(keys, perKey int) {
	f.T.Helper()
	msgs, err := f.Redis.XRange(f.Ctx, f.StreamPrefix()+"account", "-", "+").Result()
	if err != nil {
		f.T.Fatal(err)
	}
	if len(msgs) != keys*perKey {
		f.T.Fatalf("stream holds %d entries, want %d", len(msgs), keys*perKey)
	}
	next := map[string]int{}
	for _, m := range msgs {
		agg := m.Values["aggregate_id"].(string)
		var p struct{ N int }
		if err := json.Unmarshal([]byte(m.Values["payload"].(string)), &p); err != nil {
			f.T.Fatal(err)
		}
		if p.N != next[agg] {
			f.T.Fatalf("aggregate %s: got event %d, want %d (out of order)", agg, p.N, next[agg])
		}
		next[agg]++
	}
}

// PublishThroughFlakyRelays runs four relays with the given partitions,
// small batches and fast backoff through a Redis that fails 30 % of the
// XADDs, until all total events are published, and checks that some publish
// did fail (so that retries were exercised).
func (f *Fixture) PublishThroughFlakyRelays(partitions, total int) {
	f.T.Helper()
	flaky := &FlakyRedis{Client: f.Redis.Client, FailRate: 0.3}
	for i := range 4 {
		cfg := f.RelayConfig(fmt.Sprintf("r%d", i))
		cfg.Partitions = partitions
		cfg.BatchSize = 7
		cfg.PollInterval = 5 * time.Millisecond
		cfg.BackoffBase, cfg.BackoffMax, cfg.MaxAttempts = time.Millisecond, 20*time.Millisecond, 1000
		f.Run(f.NewRelay(cfg, flaky).Run)
	}
	outboxtest.Eventually(f.T, 60*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == total
	}, "not every event was published")
	if n := f.Count("SELECT count(*) FROM outbox_messages WHERE attempts > 0"); n == 0 {
		f.T.Fatal("no publish failed; the test did not exercise retries")
	}
}

// OutboxCmd runs the real binary (built with fail points) against this
// fixture's servers, with failpoint armed ("" for none).
func (f *Fixture) OutboxCmd(failpoint string, args ...string) *exec.Cmd {
	cmd := exec.Command(outboxtest.Binary(f.T), args...)
	cmd.Env = append(os.Environ(), "DATABASE_URL="+f.DBURL, "REDIS_URL="+f.Redis.URL, "OUTBOX_FAILPOINT="+failpoint)
	return cmd
}

// RunUntilKilled runs cmd and expects the armed fail point to SIGKILL it.
func (f *Fixture) RunUntilKilled(cmd *exec.Cmd) {
	f.T.Helper()
	out, err := RunWithTimeout(cmd, 30*time.Second)
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		f.T.Fatalf("%v: want death by SIGKILL at the fail point, got %v\n%s", cmd.Args, err, out)
	}
}

// RunWithTimeout runs cmd, killing it after d, and returns its output.
func RunWithTimeout(cmd *exec.Cmd, d time.Duration) ([]byte, error) {
	var buf SyncBuffer
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
