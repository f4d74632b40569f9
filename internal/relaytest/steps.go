package relaytest

import (
	"context"
	"testing"
	"time"

	"github.com/tedbank/outbox/internal/hooks"
	"github.com/tedbank/outbox/internal/testsignal"
	"github.com/tedbank/outbox/relay"
)

// DrainBatch claims one batch, publishes it and records the outcome, as a
// running relay's drain does once (it must not be called while Run runs).
// It is not part of package relay's API: a service runs Run.
func DrainBatch(ctx context.Context, r *relay.Relay) (relay.BatchResult, error) {
	return hooks.Call[*relay.Relay, relay.BatchResult](ctx, hooks.RelayDrainBatch, r)
}

// Reap returns expired claims to pending, as one pass of the relay's
// reaper: how many it returned.
func Reap(ctx context.Context, r *relay.Relay) (int, error) {
	return hooks.Call[*relay.Relay, int](ctx, hooks.RelayReap, r)
}

// Signals returns r's test signals, initialized: call it before r runs.
func Signals(r *relay.Relay) testsignal.Relay {
	s, err := hooks.Call[*relay.Relay, testsignal.Relay](context.Background(), hooks.RelaySignals, r)
	if err != nil {
		panic(err)
	}
	s.Init()
	return s
}

// WaitCaughtUp waits until the relay of s (Signals) is idle and caught up
// on a LISTEN connection made after its first after ones: listening, the
// drain that connection asked for when it came up has run, and no wake-up
// is queued. It returns the connection's number: give it back as after to
// wait for the catch-up after a reconnection.
func WaitCaughtUp(t testing.TB, s testsignal.Relay, after uint64) uint64 {
	t.Helper()
	n, err := s.Idle.WaitFor(10*time.Second, func(n uint64) bool { return n > after })
	if err != nil {
		t.Fatalf("the relay never went idle, caught up after LISTEN connection %d: %v", after, err)
	}
	return n
}
