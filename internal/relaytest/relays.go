package relaytest

import (
	"context"
	_ "embed"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/relay/broker"
	"github.com/tedbank/outbox/relay/redisbroker"
)

// RelayConfig is a relay of this fixture, polling only every ten minutes
// (so that a test passing in time proves the wake-up, not the poll). Its
// ownership is OUTBOX_RELAY_OWNERSHIP's (auto in make test's second pass:
// partition leases, unless a relay claiming rows runs), else the zero
// value's (row claims, the card's); the tests of one ownership set
// Ownership themselves, and Relay.Ownership says which one a relay runs.
//
// make test runs again, with OUTBOX_RELAY_OWNERSHIP=auto, only the tests
// listed in ownership_tests.txt: a test that calls RelayConfig must be
// listed there, or it fails, so that no test of a relay of the variable's
// ownership misses the second pass.
func (f *Fixture) RelayConfig(name string) relay.Config {
	f.T.Helper()
	if top, _, _ := strings.Cut(f.T.Name(), "/"); !slices.Contains(OwnershipTests(), top) {
		f.T.Errorf("%s runs a relay of OUTBOX_RELAY_OWNERSHIP's ownership: list it in internal/relaytest/ownership_tests.txt, the tests make test runs again with auto", top)
	}
	return f.RelayConfigOf(name, os.Getenv("OUTBOX_RELAY_OWNERSHIP"))
}

// ownershipTests is ownership_tests.txt: a test's name per line; '#'
// starts a comment.
//
//go:embed ownership_tests.txt
var ownershipTests string

// OwnershipTests returns the tests listed in ownership_tests.txt, read
// once.
var OwnershipTests = sync.OnceValue(func() []string {
	var names []string
	for line := range strings.Lines(ownershipTests) {
		line, _, _ = strings.Cut(line, "#")
		if line = strings.TrimSpace(line); line != "" {
			names = append(names, line)
		}
	}
	return names
})

// RelayConfigOf is RelayConfig with the ownership given, whatever
// OUTBOX_RELAY_OWNERSHIP says (auto included: auto's own tests).
func (f *Fixture) RelayConfigOf(name, ownership string) relay.Config {
	return relay.Config{Name: name, StreamPrefix: f.StreamPrefix(), PollInterval: 10 * time.Minute, Ownership: ownership}
}

// RowsRelayConfig is RelayConfig for the tests of row claims themselves
// (claimed_by, claim tokens, the reaper): Ownership OwnRows, whatever
// OUTBOX_RELAY_OWNERSHIP says.
func (f *Fixture) RowsRelayConfig(name string) relay.Config {
	return f.RelayConfigOf(name, relay.OwnRows)
}

// PartitionRelayConfig is RelayConfig with partition leases.
func (f *Fixture) PartitionRelayConfig(name string) relay.Config {
	return f.RelayConfigOf(name, relay.OwnPartitions)
}

// NewRelay returns a relay on the fixture's pool publishing to rdb (nil: the
// fixture's Redis) through a redisbroker of its defaults.
func (f *Fixture) NewRelay(cfg relay.Config, rdb redisbroker.Pipeliner) *relay.Relay {
	f.T.Helper()
	return f.NewRelayOn(cfg, f.RedisBroker(rdb, redisbroker.Config{}))
}

// RedisBroker returns a broker publishing to rdb (nil: the fixture's Redis).
func (f *Fixture) RedisBroker(rdb redisbroker.Pipeliner, cfg redisbroker.Config) *redisbroker.Broker {
	f.T.Helper()
	if rdb == nil {
		rdb = f.Redis.Client
	}
	b, err := redisbroker.New(rdb, cfg)
	if err != nil {
		f.T.Fatal(err)
	}
	return b
}

// NewRelayOn returns a relay on the fixture's pool publishing through b.
func (f *Fixture) NewRelayOn(cfg relay.Config, b broker.Broker) *relay.Relay {
	f.T.Helper()
	r, err := relay.New(f.Pool, b, cfg)
	if err != nil {
		f.T.Fatal(err)
	}
	return r
}

// NewRelayWithPool returns a relay on pool publishing to the fixture's Redis.
func (f *Fixture) NewRelayWithPool(pool *pgxpool.Pool, cfg relay.Config) *relay.Relay {
	f.T.Helper()
	r, err := relay.New(pool, f.RedisBroker(nil, redisbroker.Config{}), cfg)
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
		res, err := DrainBatch(f.Ctx, r)
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
		res, err := DrainBatch(f.Ctx, r)
		if err != nil {
			f.T.Fatal(err)
		}
		published += res.Published
		if res.Claimed == 0 {
			return published
		}
	}
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
