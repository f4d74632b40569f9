package relay_test

import (
	"github.com/tedbank/outbox/internal/relaytest"
	"testing"
)

// A stream nobody has created a group on yet is not trimmed: its consumers
// may simply not have started.
func TestTrimmingLeavesStreamsWithoutGroups(t *testing.T) {
	f := newFixture(t)
	f.Settle(30)
	cfg := f.RelayConfig("r1")
	cfg.StreamMaxLen = 5
	r := f.NewRelay(cfg, nil)
	if _, err := relaytest.DrainBatch(f.Ctx, r); err != nil {
		t.Fatal(err)
	}
	if n, err := relaytest.TrimStream(f.Ctx, r, f.Redis.Client, f.Stream()); err != nil || n != 0 {
		t.Fatalf("trimmed %d (err %v) from a stream with no consumer group", n, err)
	}
}
