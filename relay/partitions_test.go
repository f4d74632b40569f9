package relay_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/relaytest"
	"github.com/tedbank/outbox/partition"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/transfer"
)

// The slot SQL computes for a key is the one the relay computes in Go
// (partition.Of): the relay fences each row's mark with its slot's token.
func TestRelaySlotMatchesPartitionOf(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	for i := range 2000 {
		key := fmt.Sprintf("acct-%d", i*7919)
		for _, n := range []int{1, 16, 1024} {
			var got int
			if err := f.Pool.QueryRow(f.Ctx, "SELECT outbox_relay_slot($1, $2)", key, n).Scan(&got); err != nil {
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
	cfgA := f.PartitionRelayConfig("a")
	cfgA.Lease = time.Hour // only a renewal moves a slot: nothing expires
	stopA := f.Run(f.NewRelay(cfgA, nil).Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		h := f.LeaseHolders()
		return len(h) == 1 && h.Total() == 16
	}, "relay a did not take every slot: %v", f.LeaseHolders)

	cfgB := f.PartitionRelayConfig("b")
	cfgB.Lease = time.Hour
	f.Run(f.NewRelay(cfgB, nil).Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		h := f.LeaseHolders()
		return len(h) == 2 && h.Total() == 16 && h.Each(8)
	}, "the slots were not split 8 and 8")

	// outbox status shows who holds the slots.
	out, err := f.OutboxCmd("", "status", "--json").Output()
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
		h := f.LeaseHolders()
		return len(h) == 1 && h.Total() == 16
	}, "relay b did not take relay a's slots after a stopped")
	var members int
	if err := f.Pool.QueryRow(f.Ctx, "SELECT count(*) FROM outbox_relay_members").Scan(&members); err != nil || members != 1 {
		t.Fatalf("%d members after a stopped (err %v), want 1", members, err)
	}
}

// Events of one partition key reach the stream in the order they were
// written, with four relays leasing partitions, random publish failures
// and retries (the read's anti-join and one event per key per batch).
func TestPartitionOwnersKeepOrderThroughFailures(t *testing.T) {
	f := newFixture(t)
	const keys, perKey = 40, 20
	flaky := &relaytest.FlakyRedis{Client: f.Redis.Client, FailRate: 0.3}
	for i := range 4 {
		cfg := f.PartitionRelayConfig(fmt.Sprintf("r%d", i))
		cfg.BatchSize = 7
		cfg.PollInterval = 5 * time.Millisecond
		cfg.BackoffBase, cfg.BackoffMax, cfg.MaxAttempts = time.Millisecond, 20*time.Millisecond, 1000
		f.Run(f.NewRelay(cfg, flaky).Run)
	}
	outboxtest.Eventually(t, 20*time.Second, func() bool {
		h := f.LeaseHolders()
		return len(h) == 4 && h.Each(4)
	}, "the four relays did not share the slots")
	f.WriteInterleaved(keys, perKey)
	outboxtest.Eventually(t, 60*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == keys*perKey
	}, "not every event was published")
	if n := f.Count("SELECT count(*) FROM outbox_messages WHERE attempts > 0"); n == 0 {
		t.Fatal("no publish failed; the test did not exercise retries")
	}
	if n := f.Count("SELECT count(*) FROM outbox_messages WHERE claim_token IS NOT NULL OR status = 'publishing'"); n != 0 {
		t.Fatalf("%d rows were claimed: partition owners must not claim rows", n)
	}
	f.CheckInterleavedOrder(keys, perKey)
}

// A relay restarted under the name of one that was killed takes its slots
// back at once (with new tokens), without waiting for the leases.
func TestRestartedPartitionOwnerTakesItsSlotsBack(t *testing.T) {
	f := newFixture(t)
	cmd := f.OutboxCmd("relay.after-claim", "relay", "--name", "r1", "--stream-prefix", f.StreamPrefix(),
		"--ownership", "partitions", "--lease", "1h")
	f.Settle(3)
	f.RunUntilKilled(cmd) // read its rows, then died holding every slot for an hour
	var before []string
	rows, err := f.Pool.Query(f.Ctx, "SELECT token::text FROM outbox_relay_partitions WHERE owner = 'r1' AND lease_until > now() ORDER BY slot")
	if err != nil {
		t.Fatal(err)
	}
	if before, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil || len(before) != 16 {
		t.Fatalf("the killed relay holds %d slots (err %v), want 16", len(before), err)
	}

	cfg := f.PartitionRelayConfig("r1")
	cfg.Lease = time.Hour
	f.Run(f.NewRelay(cfg, nil).Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 3
	}, "the restarted relay did not publish its predecessor's slots")
	if n := f.Count("SELECT count(*) FROM outbox_relay_partitions WHERE token::text = ANY($1)", before); n != 0 {
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
	var logs relaytest.SyncBuffer
	log := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	for _, name := range []string{"a", "b"} {
		cfg := f.PartitionRelayConfig(name)
		cfg.Logger = log.With("relay", name)
		f.Run(f.NewRelay(cfg, nil).Run)
	}
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		h := f.LeaseHolders()
		return len(h) == 2 && h.Each(8)
	}, "the two relays did not share the slots")
	slotsOf := func(owner string) map[int]bool {
		rows, err := f.Pool.Query(f.Ctx, "SELECT slot FROM outbox_relay_partitions WHERE owner = $1", owner)
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
		if _, err := transfer.Settle(f.Ctx, f.Pool, ted); err != nil {
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
		return f.Count("SELECT count(*) FROM outbox_messages WHERE partition_key = ANY($1) AND status = 'published'", sendersB) == len(sendersB)
	}, "TEDs committed in b's slots while a was busy waited for b's poll (ten minutes)")
}

// A partition owner alone on its database, holding every slot, wakes no one:
// its wake-up NOTIFY would make each of its round trips wait for the lock
// that notifying commits take in turn (100 ms and more behind writers that
// notify). Relay a drains a stream of commits alone, busy and asleep in
// turn, and sends no wake-up; then relay b starts, takes its share at a's
// next renewal, and TEDs committed in b's slots while a is busy are
// published without waiting for b's poll (ten minutes): a wakes b again.
func TestLonePartitionOwnerWakesNoOne(t *testing.T) {
	f := newFixture(t)
	var logs relaytest.SyncBuffer
	log := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	start := func(name string) {
		cfg := f.PartitionRelayConfig(name)
		cfg.Logger = log.With("relay", name)
		f.Run(f.NewRelay(cfg, nil).Run)
	}
	busy := func(name string, from int) func() bool { // in the logs after their first from bytes
		return func() bool {
			l := logs.Bytes()[from:]
			return bytes.Contains(l, []byte("state=busy relay="+name)) || bytes.Contains(l, []byte("relay="+name+" state=busy"))
		}
	}

	// Every wake-up sent on the relays' channel, by payload.
	conn, err := f.Pool.Acquire(f.Ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := conn.Exec(f.Ctx, "LISTEN "+relay.DefaultChannel); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	wakes := map[string]int{}
	lctx, lcancel := context.WithCancel(f.Ctx)
	var lwg sync.WaitGroup
	lwg.Go(func() {
		for {
			n, err := conn.Conn().WaitForNotification(lctx)
			if err != nil {
				return
			}
			mu.Lock()
			wakes[n.Payload]++
			mu.Unlock()
		}
	})
	stopListening := func() map[string]int {
		lcancel()
		lwg.Wait()
		mu.Lock()
		defer mu.Unlock()
		return maps.Clone(wakes)
	}
	defer stopListening()

	start("a")
	outboxtest.Eventually(t, 10*time.Second, func() bool { return f.LeaseHolders()["a"] == 16 }, "relay a did not take the 16 slots")
	settle := func(from string) {
		ted := transfer.Transfer{ID: uuid.New(), FromAccount: from, ToAccount: "acct-x", AmountCents: 100}
		if _, err := transfer.Settle(f.Ctx, f.Pool, ted); err != nil {
			t.Error(err)
		}
	}
	writers := func(senders func(i int) string) (stop func()) {
		var wg sync.WaitGroup
		done := make(chan struct{})
		for w := range 8 {
			wg.Go(func() {
				for i := w; ; i += 8 {
					select {
					case <-done:
						return
					default:
					}
					settle(senders(i))
				}
			})
		}
		return func() { close(done); wg.Wait() }
	}
	stop := writers(func(i int) string { return fmt.Sprintf("acct-%d", i%200) })
	outboxtest.Eventually(t, 10*time.Second, busy("a", 0), "relay a never told writers it was busy")
	time.Sleep(time.Second) // busy and asleep in turn, alone
	stop()
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status <> 'published'") == 0
	}, "relay a did not publish the TEDs")
	if got := stopListening()["relay:a"]; got != 0 {
		t.Fatalf("relay a, alone with every slot, sent %d wake-ups", got)
	}

	start("b")
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		h := f.LeaseHolders()
		return len(h) == 2 && h.Each(8)
	}, "relay b did not get its share of the slots")
	ofA := map[int]bool{}
	var inB []string
	rows, err := f.Pool.Query(f.Ctx, "SELECT slot FROM outbox_relay_partitions WHERE owner = 'a'")
	if err != nil {
		t.Fatal(err)
	}
	slots, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range slots {
		ofA[int(s)] = true
	}
	var inA []string
	for i := 0; len(inA) < 50 || len(inB) < 20; i++ {
		key := fmt.Sprintf("acct-b-%d", i)
		if ofA[partition.Of(key, 16)] {
			inA = append(inA, key)
		} else {
			inB = append(inB, key)
		}
	}
	from := len(logs.Bytes())
	stop = writers(func(i int) string { return inA[i%len(inA)] })
	defer stop()
	outboxtest.Eventually(t, 10*time.Second, busy("a", from), "relay a never told writers it was busy beside b")
	for _, from := range inB[:20] {
		settle(from)
	}
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE partition_key = ANY($1) AND status = 'published'", inB[:20]) == 20
	}, "TEDs committed in b's slots while a was busy waited for b's poll (ten minutes)")
}

// A relay whose lease renewals failed for longer than a read may wait (its
// slots' leases run too short to read, so its reads skip them) reads them
// again the moment a renewal goes through: the rows committed meanwhile were
// left behind by those reads, and the notifications that announced them are
// spent, so without a drain at that renewal they would wait for the
// fallback poll (here ten minutes; five seconds by default). Found behind
// the chaos suite's blackhole: renewals that timed out on a half-open link.
func TestRenewalAfterFailedOnesDrainsTheSlotsItCouldNotRead(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	var logs relaytest.SyncBuffer
	cfg := f.PartitionRelayConfig("renewing")
	cfg.Lease = 2 * time.Second // a read needs a lease a second long (the publish timeout)
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	r := f.NewRelay(cfg, nil)
	sig := relaytest.Signals(r)
	f.Run(r.Run)
	relaytest.WaitCaughtUp(t, sig, 0)

	// Renewals wait on this relay's membership row, and time out (3 s).
	tx, err := f.Pool.Begin(f.Ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.WithoutCancel(f.Ctx)) //nolint:errcheck // after Commit, a no-op
	if _, err := tx.Exec(f.Ctx, "SELECT 1 FROM outbox_relay_members WHERE owner = 'renewing' FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	const failed = "partition lease renewal failed"
	outboxtest.Eventually(t, 10*time.Second, func() bool { return bytes.Contains(logs.Bytes(), []byte(failed)) },
		"no renewal failed while the membership row was locked")

	// A TED now: its notification's drain cannot read its slot. Two more
	// renewals fail after its commit (3 s each), so that drain has begun,
	// its renewal failed and its read skipped the slot. (Waiting for the
	// relay to go idle instead failed under load: while renewals fail, the
	// drain may go on reading, each read after a renewal's 3 s.)
	failures := func() int { return bytes.Count(logs.Bytes(), []byte(failed)) }
	before := failures()
	f.Settle(1)
	outboxtest.Eventually(t, 20*time.Second, func() bool { return failures() >= before+2 },
		"the renewals stopped failing while the membership row was locked")
	if n := len(f.Entries(f.Stream())); n != 0 {
		t.Fatalf("%d entries published while every renewal failed: the test's premise (no slot readable) is gone", n)
	}

	if err := tx.Rollback(f.Ctx); err != nil {
		t.Fatal(err)
	}
	released := time.Now()
	outboxtest.Eventually(t, 10*time.Second, func() bool { return len(f.Entries(f.Stream())) == 1 },
		"the TED was not published after the renewals went through again")
	took := time.Since(released)
	t.Logf("published %s after the renewals went through again", took.Round(time.Millisecond))
	// A renewal is due at most every 2/3 s; then a read.
	if took > 3*time.Second {
		t.Errorf("published %s after the renewals went through again, want within 3 s", took.Round(time.Millisecond))
	}
}
