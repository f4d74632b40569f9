// Package hooks reaches single steps of the relay and the consumer that are
// not part of their API: one batch drained, one reaper pass, one read. The
// project's tests drive a relay or a consumer by hand with them (through
// internal/relaytest and internal/consumertest); a service runs Run.
//
// A Step is typed at both ends: the package that has the step sets a
// func(context.Context, T) (R, error) with Set (T: *relay.Relay, say), and
// its test kit calls it with Call and the same types. This package cannot name *relay.Relay or
// *consumer.Consumer (they import it), so it holds the function untyped
// in between; Call checks the types once and panics with both named when
// the two ends disagree (a test of each kit calls every step).
package hooks

import (
	"context"
	"fmt"
)

// Step is one single step, set by the package that has it.
type Step struct {
	name string
	fn   any // func(context.Context, T) (R, error)
}

// Set sets s to fn.
func Set[T, R any](s *Step, fn func(context.Context, T) (R, error)) { s.fn = fn }

// Call runs s on v.
func Call[T, R any](ctx context.Context, s *Step, v T) (R, error) {
	fn, ok := s.fn.(func(context.Context, T) (R, error))
	if !ok {
		var want func(context.Context, T) (R, error)
		panic(fmt.Sprintf("hooks: step %q is %T, called as %T (set in the package that has the step, which must be linked)", s.name, s.fn, want))
	}
	return fn(ctx, v)
}

// The relay's steps (package relay sets them).
var (
	// RelayDrainBatch claims one batch, publishes it and records the
	// outcome: (*relay.Relay) -> relay.BatchResult.
	RelayDrainBatch = &Step{name: "relay: drain one batch"}
	// RelayReap returns expired claims to pending: (*relay.Relay) -> how many.
	RelayReap = &Step{name: "relay: one reaper pass"}
	// RelaySignals returns the relay's test signals:
	// (*relay.Relay) -> testsignal.Relay.
	RelaySignals = &Step{name: "relay: test signals"}
)

// The consumer's steps (package consumer sets them), Redis Streams only,
// without partition ownership: (*consumer.Consumer) -> how many entries
// (ConsumerProcessPending: struct{}).
var (
	ConsumerReadNew        = &Step{name: "consumer: read new entries"}
	ConsumerProcessPending = &Step{name: "consumer: process pending entries"}
	ConsumerClaimIdle      = &Step{name: "consumer: claim idle entries"}
)
