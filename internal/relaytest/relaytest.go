// Package relaytest is the kit of the relay's integration tests, shared by
// the relay package's own tests (relay/*_test.go) and the end-to-end tests
// at the module root: a Fixture (one test's fresh database and Redis key
// prefix) with helpers to write events, run relays and look at the outcome,
// and Redis clients that stall, fail or count on purpose. Everything runs on
// real servers (internal/outboxtest finds them).
package relaytest

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/tcpproxy"
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

// ProxiedPool returns a pool to the fixture's database through a proxy of
// its own (Down cuts the database off for this pool alone), the pool's
// config (for connections of its own through the proxy) and the proxy; all
// closed when the test ends.
func (f *Fixture) ProxiedPool(appName string) (*pgxpool.Pool, *pgxpool.Config, *tcpproxy.Proxy) {
	f.T.Helper()
	cfg, err := pgxpool.ParseConfig(f.DBURL)
	if err != nil {
		f.T.Fatal(err)
	}
	proxy, err := tcpproxy.Start(fmt.Sprintf("%s:%d", cfg.ConnConfig.Host, cfg.ConnConfig.Port))
	if err != nil {
		f.T.Fatal(err)
	}
	ViaProxy(&cfg.ConnConfig.Config, proxy)
	if appName != "" {
		cfg.ConnConfig.RuntimeParams["application_name"] = appName
	}
	pool, err := pgxpool.NewWithConfig(f.Ctx, cfg)
	if err != nil {
		_ = proxy.Close()
		f.T.Fatal(err)
	}
	CloseBehind(f.T, pool, proxy)
	return pool, cfg, proxy
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

// FirstEntry is the first entry of one event in a stream: the event's
// value of the id field asked for, its key field's, and when the entry was
// added (its stream id's milliseconds).
type FirstEntry struct {
	ID, Key string
	At      time.Time
}

// FirstEntries returns, in stream order, the first entry of each distinct
// value of idField in stream (later copies are duplicates), with its value
// of keyField.
func (f *Fixture) FirstEntries(stream, idField, keyField string) []FirstEntry {
	f.T.Helper()
	msgs, err := f.Redis.XRange(f.Ctx, stream, "-", "+").Result()
	if err != nil {
		f.T.Fatal(err)
	}
	seen := map[string]bool{}
	var out []FirstEntry
	for _, m := range msgs {
		id, _ := m.Values[idField].(string)
		if seen[id] {
			continue
		}
		seen[id] = true
		ms, err := strconv.ParseInt(strings.SplitN(m.ID, "-", 2)[0], 10, 64)
		if err != nil {
			f.T.Fatal(err)
		}
		key, _ := m.Values[keyField].(string)
		out = append(out, FirstEntry{ID: id, Key: key, At: time.UnixMilli(ms)})
	}
	return out
}

// CloseBehind closes pool, then proxy, when the test ends, the proxy first:
// a connection the proxy froze would hold the pool's Close for 15 s (pgx
// waits that long for the server to acknowledge a closing connection),
// where a closed proxy ends them at once.
func CloseBehind(t testing.TB, pool *pgxpool.Pool, proxy *tcpproxy.Proxy) {
	t.Cleanup(pool.Close)
	t.Cleanup(func() { _ = proxy.Close() })
}
