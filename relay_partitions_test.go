package outbox_test

import (
	"syscall"
	"testing"
	"time"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/relaytest"
)

// Relays with partition leases (relay.Config.Ownership = "partitions").

// A relay that stalls after publishing, past its lease, loses its slots to
// another relay; its late mark changes nothing (fenced by the slots' tokens)
// and the other relay publishes and marks the rows.
func TestStalePartitionOwnerIsFenced(t *testing.T) {
	f := newFixture(t)
	teds := f.Settle(10) // ten senders: one batch each for A and B

	stallA := relaytest.NewStallingRedis(f.Redis.Client)
	cfgA := f.PartitionRelayConfig("relay-a")
	a := f.NewRelay(cfgA, stallA)
	resA := f.DrainInBackground(a)
	<-stallA.Published // A published and is now stuck before marking

	// A's leases run out (aged on the database clock, no sleeping); B
	// takes every slot with new tokens, publishes and marks.
	f.ExpireRelayLeases()
	stallB := relaytest.NewStallingRedis(f.Redis.Client)
	b := f.NewRelay(f.PartitionRelayConfig("relay-b"), stallB)
	resB := f.DrainInBackground(b)
	<-stallB.Published // B read and published the same rows; it has not marked yet

	close(stallA.Release)
	if res := <-resA; res.Claimed != 10 || res.Published != 0 || res.Fenced != 10 {
		t.Fatalf("stale relay A: %+v, want its 10 rows fenced, none published", res)
	}
	if n := f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'pending'"); n != 10 {
		t.Fatalf("%d rows pending after A's late mark, want 10 (left to relay B)", n)
	}
	close(stallB.Release)
	if res := <-resB; res.Published != 10 || res.Fenced != 0 {
		t.Fatalf("relay B: %+v, want 10 published", res)
	}
	if got := len(f.Entries(f.Stream())); got != 20 {
		t.Fatalf("stream holds %d entries, want 20 (each event twice)", got)
	}
	f.Run(f.consumer("c1", nil).Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return f.report().DuplicatesSkipped == 10 }, "duplicates not skipped")
	f.checkEffectsOnce(teds)
}

// A relay process killed with its leases held: another relay takes its
// slots when the leases run out and publishes everything, each effect once.
func TestKilledPartitionOwnersSlotsMoveWithinTheLease(t *testing.T) {
	f := newFixture(t)
	cmd := f.OutboxCmd("", "relay", "--stream-prefix", f.StreamPrefix(), "--ownership", "partitions", "--lease", "2s")
	var out relaytest.SyncBuffer
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
	outboxtest.Eventually(t, 20*time.Second, func() bool { return f.LeaseHolders().Total() == 16 },
		"the relay process did not take the slots")
	teds := f.Settle(5)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 5
	}, "the relay process did not publish")
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-exited
	killed := time.Now()
	more := f.Settle(5) // wait for the dead relay's leases
	cfg := f.PartitionRelayConfig("r2")
	cfg.Lease = 2 * time.Second
	f.Run(f.NewRelay(cfg, nil).Run)
	outboxtest.Eventually(t, 15*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 10
	}, "the dead relay's slots did not move")
	if d := time.Since(killed); d < time.Second {
		t.Fatalf("published %s after the kill: the dead relay's leases (2s) were not respected", d)
	}
	f.Run(f.consumer("c1", nil).Run)
	all := append(teds, more...) //nolint:gocritic // teds is not used again
	outboxtest.Eventually(t, 10*time.Second, func() bool { return f.report().Verdicts == int64(len(all)) }, "verdicts missing")
	f.checkEffectsOnce(all)
}
