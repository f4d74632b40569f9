package demo

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
)

// step is a point in an event's life, as the demo observes it.
type step int

const (
	stepCommitted step = iota // Settle returned
	stepNotified              // the demo's own LISTEN connection got the NOTIFY
	stepClaimed               // a relay claimed the row
	stepPublished             // the relay's XADD succeeded
	stepVerdict               // anti-fraud applied the effect
	numSteps
)

// timeline is when each step happened to one event.
type timeline struct {
	start   time.Time // Settle was called
	at      [numSteps]time.Time
	verdict string
}

func (t timeline) done() bool { return !t.at[stepVerdict].IsZero() }

// stepNames are the steps as a timeline prints them. The transaction
// commits before Settle returns ("settled"): its NOTIFY, and even the
// relay's claim, can come before the reply reaches the caller.
var stepNames = [numSteps]string{"settled", "notified", "claimed", "published", "judged"}

// String is the steps seen, in the order they happened, each in ms since
// Settle was called: "notified 1.99 → settled 2.36 → claimed 2.61 → ...".
func (t timeline) String() string {
	order := make([]step, 0, numSteps)
	for s := range numSteps {
		if !t.at[s].IsZero() {
			order = append(order, s)
		}
	}
	slices.SortStableFunc(order, func(a, b step) int { return t.at[a].Compare(t.at[b]) })
	parts := make([]string, len(order))
	for i, s := range order {
		parts[i] = fmt.Sprintf("%s %.2f", stepNames[s], float64(t.at[s].Sub(t.start).Microseconds())/1000)
	}
	return strings.Join(parts, " → ") + " ms"
}

// timelines records timelines by event id. Relay and consumer hooks call it
// from their own goroutines.
type timelines struct {
	mu            sync.Mutex
	byID          map[uuid.UUID]*timeline
	notifications []time.Time // recent, in arrival order
	awaiting      []*timeline // committed, not yet matched to a notification
}

func newTimelines() *timelines { return &timelines{byID: map[uuid.UUID]*timeline{}} }

func (ts *timelines) entry(id uuid.UUID) *timeline {
	t := ts.byID[id]
	if t == nil {
		t = &timeline{}
		ts.byID[id] = t
	}
	return t
}

// begin records a committed event: Settle was called at start and returned
// at committed. A notification can arrive before Settle returns, so recent
// ones are matched here too.
func (ts *timelines) begin(id uuid.UUID, start, committed time.Time) {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	t := ts.entry(id)
	t.start, t.at[stepCommitted] = start, committed
	for _, n := range ts.notifications {
		if !n.Before(start) {
			t.at[stepNotified] = n
			return
		}
	}
	ts.awaiting = append(ts.awaiting, t)
}

// notified records a notification: the first one after an event's Settle
// call is its notification.
func (ts *timelines) notified(at time.Time) {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	ts.notifications = append(ts.notifications, at)
	if len(ts.notifications) > 256 {
		ts.notifications = ts.notifications[len(ts.notifications)-256:]
	}
	kept := ts.awaiting[:0]
	for _, t := range ts.awaiting {
		if t.start.After(at) {
			kept = append(kept, t)
			continue
		}
		t.at[stepNotified] = at
	}
	ts.awaiting = kept
}

func (ts *timelines) mark(id uuid.UUID, s step, verdict string) {
	now := time.Now()
	ts.mu.Lock()
	defer ts.mu.Unlock()
	t := ts.entry(id)
	if t.at[s].IsZero() {
		t.at[s] = now
	}
	if verdict != "" && t.verdict == "" {
		t.verdict = verdict
	}
}

func (ts *timelines) markAll(ids []uuid.UUID, s step) {
	now := time.Now()
	ts.mu.Lock()
	defer ts.mu.Unlock()
	for _, id := range ids {
		if t := ts.entry(id); t.at[s].IsZero() {
			t.at[s] = now
		}
	}
}

// get returns a copy of an event's timeline.
func (ts *timelines) get(id uuid.UUID) timeline {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	if t := ts.byID[id]; t != nil {
		return *t
	}
	return timeline{}
}
