package outbox_test

import (
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
	t.Parallel()
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
