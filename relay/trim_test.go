package relay_test

import (
	"testing"

	"github.com/tedbank/outbox/internal/relaytest"
	"github.com/tedbank/outbox/relay/redisbroker"
)

// A stream nobody has created a group on yet is not trimmed: its consumers
// may simply not have started.
func TestTrimmingLeavesStreamsWithoutGroups(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.Settle(30)
	b := f.RedisBroker(nil, redisbroker.Config{StreamMaxLen: 5})
	r := f.NewRelayOn(f.RelayConfig("r1"), b)
	if _, err := relaytest.DrainBatch(f.Ctx, r); err != nil {
		t.Fatal(err)
	}
	if n, err := b.TrimStream(f.Ctx, f.Stream()); err != nil || n != 0 {
		t.Fatalf("trimmed %d (err %v) from a stream with no consumer group", n, err)
	}
}
