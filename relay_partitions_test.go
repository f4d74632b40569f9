package outbox_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/partition"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/transfer"
)

// Relays with partition leases (relay.Config.Ownership = "partitions").

func (f *fixture) partitionRelayConfig(name string) relay.Config {
	cfg := f.relayConfig(name)
	cfg.Ownership = relay.OwnPartitions
	return cfg
}

// leaseHolders returns how many slots each relay instance holds with a live
// lease.
func (f *fixture) leaseHolders() map[string]int {
	f.t.Helper()
	rows, err := f.pool.Query(f.ctx, `SELECT owner, count(*)::int FROM outbox_relay_partitions
		WHERE owner IS NOT NULL AND lease_until > now() GROUP BY owner`)
	if err != nil {
		f.t.Fatal(err)
	}
	held := map[string]int{}
	for rows.Next() {
		var owner string
		var n int
		if err := rows.Scan(&owner, &n); err != nil {
			f.t.Fatal(err)
		}
		held[owner] = n
	}
	if err := rows.Err(); err != nil {
		f.t.Fatal(err)
	}
	return held
}

// expireRelayLeases ages every relay's partition leases and membership past
// their end, on the database clock: the relays holding them are as good as
// dead to the others.
func (f *fixture) expireRelayLeases() {
	f.t.Helper()
	for _, q := range []string{
		"UPDATE outbox_relay_partitions SET lease_until = now() - interval '1 second'",
		"UPDATE outbox_relay_members SET seen_until = now() - interval '1 second'",
	} {
		if _, err := f.pool.Exec(f.ctx, q); err != nil {
			f.t.Fatal(err)
		}
	}
}

// The slot SQL computes for a key is the one the relay computes in Go
// (partition.Of): the relay fences each row's mark with its slot's token.
func TestRelaySlotMatchesPartitionOf(t *testing.T) {
	f := newFixture(t)
	for i := range 2000 {
		key := fmt.Sprintf("acct-%d", i*7919)
		for _, n := range []int{1, 16, 1024} {
			var got int
			if err := f.pool.QueryRow(f.ctx, "SELECT outbox_relay_slot($1, $2)", key, n).Scan(&got); err != nil {
				t.Fatal(err)
			}
			if want := partition.Of(key, n); got != want {
				t.Fatalf("outbox_relay_slot(%q, %d) = %d, partition.Of = %d", key, n, got, want)
			}
		}
	}
}

// Relays divide the slots among themselves, a joining relay gets its share,
// and a relay that stops gives its slots back at once (not after the lease).
func TestPartitionLeasesRebalance(t *testing.T) {
	f := newFixture(t)
	cfgA := f.partitionRelayConfig("a")
	cfgA.Lease = time.Hour // only a renewal moves a slot: nothing expires
	stopA := f.run(f.newRelay(cfgA, nil).Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		h := f.leaseHolders()
		return len(h) == 1 && sum(h) == 16
	}, "relay a did not take every slot: %v", f.leaseHolders)

	cfgB := f.partitionRelayConfig("b")
	cfgB.Lease = time.Hour
	f.run(f.newRelay(cfgB, nil).Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		h := f.leaseHolders()
		return len(h) == 2 && sum(h) == 16 && all(h, 8)
	}, "the slots were not split 8 and 8")

	// outbox status shows who holds the slots.
	out, err := f.outboxCmd("", "status", "--json").Output()
	if err != nil {
		t.Fatalf("outbox status: %v", err)
	}
	var st struct {
		RelaySlots     map[string]int `json:"relay_slots"`
		RelaySlotsFree int            `json:"relay_slots_free"`
	}
	if err := json.Unmarshal(out, &st); err != nil || st.RelaySlots["a"] != 8 || st.RelaySlots["b"] != 8 || st.RelaySlotsFree != 0 {
		t.Fatalf("outbox status: %+v (%v), want a 8, b 8, free 0\n%s", st, err, out)
	}

	stopA()
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		h := f.leaseHolders()
		return len(h) == 1 && sum(h) == 16
	}, "relay b did not take relay a's slots after a stopped")
	var members int
	if err := f.pool.QueryRow(f.ctx, "SELECT count(*) FROM outbox_relay_members").Scan(&members); err != nil || members != 1 {
		t.Fatalf("%d members after a stopped (err %v), want 1", members, err)
	}
}

func sum(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

func all(m map[string]int, want int) bool {
	for _, v := range m {
		if v != want {
			return false
		}
	}
	return true
}

// Events of one partition key reach the stream in the order they were
// written, with four relays leasing partitions, random publish failures
// and retries (the read's anti-join and one event per key per batch).
func TestPartitionOwnersKeepOrderThroughFailures(t *testing.T) {
	f := newFixture(t)
	const keys, perKey = 40, 20
	flaky := &flakyRedis{Client: f.rdb.Client, failRate: 0.3}
	for i := range 4 {
		cfg := f.partitionRelayConfig(fmt.Sprintf("r%d", i))
		cfg.BatchSize = 7
		cfg.PollInterval = 5 * time.Millisecond
		cfg.BackoffBase, cfg.BackoffMax, cfg.MaxAttempts = time.Millisecond, 20*time.Millisecond, 1000
		f.run(f.newRelay(cfg, flaky).Run)
	}
	outboxtest.Eventually(t, 20*time.Second, func() bool {
		h := f.leaseHolders()
		return len(h) == 4 && all(h, 4)
	}, "the four relays did not share the slots")
	f.writeInterleaved(keys, perKey)
	outboxtest.Eventually(t, 60*time.Second, func() bool {
		return f.count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == keys*perKey
	}, "not every event was published")
	if n := f.count("SELECT count(*) FROM outbox_messages WHERE attempts > 0"); n == 0 {
		t.Fatal("no publish failed; the test did not exercise retries")
	}
	if n := f.count("SELECT count(*) FROM outbox_messages WHERE claim_token IS NOT NULL OR status = 'publishing'"); n != 0 {
		t.Fatalf("%d rows were claimed: partition owners must not claim rows", n)
	}
	f.checkInterleavedOrder(keys, perKey)
}

// A relay that stalls after publishing, past its lease, loses its slots to
// another relay; its late mark changes nothing (fenced by the slots' tokens)
// and the other relay publishes and marks the rows.
func TestStalePartitionOwnerIsFenced(t *testing.T) {
	f := newFixture(t)
	teds := f.settle(10) // ten senders: one batch each for A and B

	stallA := &stallingRedis{Client: f.rdb.Client, published: make(chan struct{}), release: make(chan struct{})}
	cfgA := f.partitionRelayConfig("relay-a")
	a := f.newRelay(cfgA, stallA)
	resA := f.drainInBackground(a)
	<-stallA.published // A published and is now stuck before marking

	// A's leases run out (aged on the database clock, no sleeping); B
	// takes every slot with new tokens, publishes and marks.
	f.expireRelayLeases()
	stallB := &stallingRedis{Client: f.rdb.Client, published: make(chan struct{}), release: make(chan struct{})}
	b := f.newRelay(f.partitionRelayConfig("relay-b"), stallB)
	resB := f.drainInBackground(b)
	<-stallB.published // B read and published the same rows; it has not marked yet

	close(stallA.release)
	if res := <-resA; res.Claimed != 10 || res.Published != 0 || res.Fenced != 10 {
		t.Fatalf("stale relay A: %+v, want its 10 rows fenced, none published", res)
	}
	if n := f.count("SELECT count(*) FROM outbox_messages WHERE status = 'pending'"); n != 10 {
		t.Fatalf("%d rows pending after A's late mark, want 10 (left to relay B)", n)
	}
	close(stallB.release)
	if res := <-resB; res.Published != 10 || res.Fenced != 0 {
		t.Fatalf("relay B: %+v, want 10 published", res)
	}
	if got := len(f.entries(f.stream())); got != 20 {
		t.Fatalf("stream holds %d entries, want 20 (each event twice)", got)
	}
	f.run(f.consumer("c1", nil).Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return f.report().DuplicatesSkipped == 10 }, "duplicates not skipped")
	f.checkEffectsOnce(teds)
}

// A relay process killed with its leases held: another relay takes its
// slots when the leases run out and publishes everything, each effect once.
func TestKilledPartitionOwnersSlotsMoveWithinTheLease(t *testing.T) {
	f := newFixture(t)
	cmd := f.outboxCmd("", "relay", "--stream-prefix", f.streamPrefix(), "--ownership", "partitions", "--lease", "2s")
	var out syncBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
		if t.Failed() {
			t.Logf("relay process output:\n%s", out.Bytes())
		}
	})
	outboxtest.Eventually(t, 20*time.Second, func() bool { return sum(f.leaseHolders()) == 16 },
		"the relay process did not take the slots")
	teds := f.settle(5)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 5
	}, "the relay process did not publish")
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-exited
	killed := time.Now()
	more := f.settle(5) // wait for the dead relay's leases
	cfg := f.partitionRelayConfig("r2")
	cfg.Lease = 2 * time.Second
	f.run(f.newRelay(cfg, nil).Run)
	outboxtest.Eventually(t, 15*time.Second, func() bool {
		return f.count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 10
	}, "the dead relay's slots did not move")
	if d := time.Since(killed); d < time.Second {
		t.Fatalf("published %s after the kill: the dead relay's leases (2s) were not respected", d)
	}
	f.run(f.consumer("c1", nil).Run)
	all := append(teds, more...) //nolint:gocritic // teds is not used again
	outboxtest.Eventually(t, 10*time.Second, func() bool { return f.report().Verdicts == int64(len(all)) }, "verdicts missing")
	f.checkEffectsOnce(all)
}

// A relay restarted under the name of one that was killed takes its slots
// back at once (with new tokens), without waiting for the leases.
func TestRestartedPartitionOwnerTakesItsSlotsBack(t *testing.T) {
	f := newFixture(t)
	cmd := f.outboxCmd("relay.after-claim", "relay", "--name", "r1", "--stream-prefix", f.streamPrefix(),
		"--ownership", "partitions", "--lease", "1h")
	f.settle(3)
	f.runUntilKilled(cmd) // read its rows, then died holding every slot for an hour
	var before []string
	rows, err := f.pool.Query(f.ctx, "SELECT token::text FROM outbox_relay_partitions WHERE owner = 'r1' AND lease_until > now() ORDER BY slot")
	if err != nil {
		t.Fatal(err)
	}
	if before, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil || len(before) != 16 {
		t.Fatalf("the killed relay holds %d slots (err %v), want 16", len(before), err)
	}

	cfg := f.partitionRelayConfig("r1")
	cfg.Lease = time.Hour
	f.run(f.newRelay(cfg, nil).Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 3
	}, "the restarted relay did not publish its predecessor's slots")
	if n := f.count("SELECT count(*) FROM outbox_relay_partitions WHERE token::text = ANY($1)", before); n != 0 {
		t.Fatalf("%d slots kept the killed process's token, want new tokens", n)
	}
}

// Writers stop notifying while any relay is busy, but a relay that owns
// partitions drains only its own slots: while busy it wakes the others at
// every batch, and once more when it says "sleep". Relay a drains a stream
// of commits in its own slots (busy: writers silent) while relay b sleeps;
// TEDs committed meanwhile in b's slots are published without waiting for
// b's poll (ten minutes).
func TestBusyPartitionOwnerWakesTheOthers(t *testing.T) {
	f := newFixture(t)
	var logs syncBuffer
	log := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	for _, name := range []string{"a", "b"} {
		cfg := f.partitionRelayConfig(name)
		cfg.Logger = log.With("relay", name)
		f.run(f.newRelay(cfg, nil).Run)
	}
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		h := f.leaseHolders()
		return len(h) == 2 && all(h, 8)
	}, "the two relays did not share the slots")
	slotsOf := func(owner string) map[int]bool {
		rows, err := f.pool.Query(f.ctx, "SELECT slot FROM outbox_relay_partitions WHERE owner = $1", owner)
		if err != nil {
			t.Fatal(err)
		}
		slots, err := pgx.CollectRows(rows, pgx.RowTo[int32])
		if err != nil {
			t.Fatal(err)
		}
		m := map[int]bool{}
		for _, s := range slots {
			m[int(s)] = true
		}
		return m
	}
	// Senders whose TEDs fall in a's slots, and in b's.
	var sendersA, sendersB []string
	ofA, ofB := slotsOf("a"), slotsOf("b")
	for i := 0; len(sendersA) < 50 || len(sendersB) < 20; i++ {
		key := fmt.Sprintf("acct-%d", i)
		switch slot := partition.Of(key, 16); {
		case ofA[slot] && len(sendersA) < 50:
			sendersA = append(sendersA, key)
		case ofB[slot] && len(sendersB) < 20:
			sendersB = append(sendersB, key)
		}
	}
	settle := func(from string) {
		ted := transfer.Transfer{ID: uuid.New(), FromAccount: from, ToAccount: "acct-x", AmountCents: 100}
		if _, err := transfer.Settle(f.ctx, f.pool, ted); err != nil {
			t.Error(err)
		}
	}

	// Eight writers keep relay a busy until the end of the test.
	var wg sync.WaitGroup
	stop := make(chan struct{})
	defer func() { close(stop); wg.Wait() }()
	for w := range 8 {
		wg.Go(func() {
			for i := w; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				settle(sendersA[i%len(sendersA)])
			}
		})
	}
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return bytes.Contains(logs.Bytes(), []byte("state=busy relay=a")) || bytes.Contains(logs.Bytes(), []byte("relay=a state=busy"))
	}, "relay a never told writers it was busy")
	for _, from := range sendersB {
		settle(from)
	}
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.count("SELECT count(*) FROM outbox_messages WHERE partition_key = ANY($1) AND status = 'published'", sendersB) == len(sendersB)
	}, "TEDs committed in b's slots while a was busy waited for b's poll (ten minutes)")
}
