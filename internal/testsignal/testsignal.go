// Package testsignal gives services typed signals for their tests: a
// service sends on a Signal at a point its tests must wait for (a drain
// over, a reaper pass done), and a test waits on it instead of sleeping for
// a guessed time. Until a test calls Init, a send is one atomic load: the
// product pays nothing else. River's maintenance services' test signals are
// the model.
package testsignal

import (
	"fmt"
	"sync/atomic"
	"time"
)

// buffered is how many values a signal keeps for a test that has not
// waited yet; past it, the oldest are dropped.
const buffered = 256

// Signal is one point a service signals, with a value of type T.
type Signal[T any] struct {
	ch atomic.Pointer[chan T]
}

// Init makes s deliver what is sent from now on. Call it before the
// service starts.
func (s *Signal[T]) Init() {
	ch := make(chan T, buffered)
	s.ch.Store(&ch)
}

// Send delivers v to the test that waits on s, if any called Init. It never
// blocks: with the buffer full, the oldest value is dropped.
func (s *Signal[T]) Send(v T) {
	p := s.ch.Load()
	if p == nil {
		return
	}
	for {
		select {
		case *p <- v:
			return
		default:
			select {
			case <-*p:
			default:
			}
		}
	}
}

// WaitFor returns the first value sent (or kept since the last WaitFor)
// for which ok reports true, skipping the others; nil ok takes any. It
// fails after timeout, and at once when s was never initialized.
func (s *Signal[T]) WaitFor(timeout time.Duration, ok func(T) bool) (T, error) {
	var zero T
	p := s.ch.Load()
	if p == nil {
		return zero, fmt.Errorf("testsignal: %T was not initialized (Init before the service starts)", s)
	}
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for {
		select {
		case v := <-*p:
			if ok == nil || ok(v) {
				return v, nil
			}
		case <-deadline.C:
			return zero, fmt.Errorf("testsignal: no %T signal in %s", zero, timeout)
		}
	}
}

// Clear drops what was sent so far: the next WaitFor sees only what comes
// after.
func (s *Signal[T]) Clear() {
	p := s.ch.Load()
	if p == nil {
		return
	}
	for {
		select {
		case <-*p:
		default:
			return
		}
	}
}

// Relay is what a relay signals (internal/relaytest.Signals: Init them
// before Run).
type Relay struct {
	// Idle: the drainer ended a drain and waits, caught up (its LISTEN
	// connection up, and the drain that connection asked for when it came
	// up has run), with no wake-up queued. The value counts the LISTEN
	// connections the relay made up to that one: 1 for the first, 2 after
	// one reconnection.
	Idle *Signal[uint64]
	// Reaped: a pass of the reaper (expired claims, or the claims of a
	// relay found dead) returned that many claims to pending.
	Reaped *Signal[int]
}

// Init initializes every signal of r.
func (r Relay) Init() {
	r.Idle.Init()
	r.Reaped.Init()
}
