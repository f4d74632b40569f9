package leases

import (
	"testing"
	"time"

	"github.com/tedbank/outbox/internal/queries"
)

// host is a relay whose LISTEN backend is pid.
type host struct{ pid uint32 }

func (h host) OnFresh(fn func() error) error { return fn() }
func (h host) ListenPID() uint32             { return h.pid }
func (host) Freed() queries.Statement        { return queries.Statement{} }
func (host) Held(int)                        {}

// A lone partition owner sends no wake-up NOTIFY only while the LISTEN
// backend its last renewal carried is still its own: once that backend is
// gone, the other relays free its slots at once (relay_bury.sql), and one
// that joins may hold some before this relay's next renewal counts it.
func TestLoneOwnerOnlyWithTheBackendItsRenewalCarried(t *testing.T) {
	now := time.Now()
	held := map[int]lease{0: {until: now.Add(time.Minute)}, 1: {until: now.Add(time.Minute)}}
	for _, c := range []struct {
		name          string
		renewed, live uint32
		relays        int
		alone         bool
	}{
		{"its backend, alone", 42, 42, 1, true},
		{"a new backend since the renewal", 42, 43, 1, false},
		{"no backend now", 42, 0, 1, false},
		{"renewed without a backend", 0, 0, 1, false},
		{"another relay alive", 42, 42, 2, false},
	} {
		l := &Leases{host: host{pid: c.live}, slots: 2, held: held, relays: c.relays, pid: c.renewed}
		if got := l.Alone(now); got != c.alone {
			t.Errorf("%s: alone %v, want %v", c.name, got, c.alone)
		}
	}
	// A lease past its end: not alone, whatever else holds.
	expired := map[int]lease{0: {until: now.Add(time.Minute)}, 1: {until: now.Add(-time.Second)}}
	l := &Leases{host: host{pid: 42}, slots: 2, held: expired, relays: 1, pid: 42}
	if l.Alone(now) {
		t.Error("alone with a lease past its end")
	}
}
