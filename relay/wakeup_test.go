package relay

import (
	"cmp"
	"testing"
	"time"
)

func TestWakeStateTransitions(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		from  wakeState
		op    flagOp
		slept bool
		want  wakeState
	}{
		{asleep, flagNone, false, asleep},
		{asleep, flagBusy, false, saidBusy},
		{saidBusy, flagSleep, false, sleepPending},
		{saidBusy, flagSleep, true, asleep},
		{sleepPending, flagSleep, true, asleep},
		{sleepPending, flagNone, false, sleepPending},
		{unsure, flagNone, false, unsure},
		{unsure, flagSleep, true, asleep},
		{unsure, flagBusy, false, saidBusy},
	} {
		if got := c.from.after(c.op, c.slept); got != c.want {
			t.Errorf("%s after op %d (slept %v) = %s, want %s", c.from, c.op, c.slept, got, c.want)
		}
	}
	if saidBusy.notifying() || unsure.notifying() || !sleepPending.notifying() || !asleep.notifying() {
		t.Error("writers notify only after a sleep")
	}
}

func TestRetryScheduleKeepsEveryTimeUntilCovered(t *testing.T) {
	t.Parallel()
	t0 := time.Unix(1000, 0)
	var q retrySchedule
	q.add(t0.Add(3 * time.Second))
	q.add(t0.Add(1 * time.Second))
	q.add(t0.Add(2 * time.Second))
	q.add(t0.Add(2*time.Second + time.Millisecond)) // merged with 2s: moved to 2.001s
	if len(q.at) != 3 {
		t.Fatalf("schedule %v: want 3 times", q.at)
	}
	if at, ok := q.next(); !ok || !at.Equal(t0.Add(time.Second)) {
		t.Fatalf("next = %v, want 1s", at)
	}
	// A drain that started before a time does not cover it.
	q.covered(t0.Add(500 * time.Millisecond))
	if len(q.at) != 3 {
		t.Fatalf("a drain before every time covered %v", q.at)
	}
	q.covered(t0.Add(2 * time.Second))
	if at, ok := q.next(); !ok || !at.Equal(t0.Add(2*time.Second+time.Millisecond)) {
		t.Fatalf("after covering 1s and 2s: next = %v, want the merged 2.001s", at)
	}
	q.covered(t0.Add(time.Hour))
	if _, ok := q.next(); ok {
		t.Fatal("everything covered, yet a time is left")
	}
	for i := range maxScheduled + 10 {
		q.add(t0.Add(time.Duration(i) * time.Second))
	}
	if len(q.at) != maxScheduled {
		t.Fatalf("%d times kept, want the bound %d", len(q.at), maxScheduled)
	}
	q.add(t0.Add(-time.Second)) // an earlier time displaces the latest
	if at, _ := q.next(); !at.Equal(t0.Add(-time.Second)) || len(q.at) != maxScheduled {
		t.Fatalf("earliest %v, %d kept", at, len(q.at))
	}
}

// A drain tells writers it is busy only at a rate of several commits per
// busyWindow, whatever the size of each claim: at a low rate, two single-row
// claims in a row (a commit landing during the first's publish) must not put
// the relay in the busy state, where each commit waits up to a linger step
// for the next claim; a fast relay whose claims each find a row or two of a
// steady stream must. Claims further apart than busyWindow (slow round
// trips) count on their own: busy when one after the first of a drain finds
// BusyRows rows. A full batch, however small, is a backlog.
func TestBusyOnlyAtARateOfSeveralCommits(t *testing.T) {
	ctx := t.Context()
	apart := busyWindow + 5*time.Millisecond
	for _, c := range []struct {
		batch   int
		claimed []int
		gap     time.Duration // between claims
		busy    bool
		rows    int // Config.BusyRows (0: the default)
	}{
		{500, []int{1, 1, 1}, 0, false, 0},
		{500, []int{1, DefaultBusyRows - 2}, 0, false, 0},
		{500, []int{1, DefaultBusyRows - 1}, 0, true, 0},
		{500, []int{1, 1, 1, 1, 1, 1, 1, 1}, 0, true, 0}, // a fast relay in a stream
		{500, []int{DefaultBusyRows}, 0, false, 0},       // a drain's first claim, no recent claims: a wake-up
		{500, []int{4, 4, 4}, apart, false, 0},           // a slow trickle
		{500, []int{1, DefaultBusyRows}, apart, true, 0}, // slow round trips in a stream
		{1, []int{1, 1}, apart, true, 0},
		{500, []int{1, 1}, 0, true, 2},
		{500, []int{1}, 0, false, 2},
	} {
		r := &Relay{listener: &listener{}, cfg: Config{BatchSize: c.batch, BusyRows: cmp.Or(c.rows, DefaultBusyRows)}}
		r.listener.pid.Store(42)
		w := r.newWakeup(false)
		for i, n := range c.claimed {
			if i > 0 {
				time.Sleep(c.gap)
			}
			w.sent(BatchResult{Claimed: n}, nil)
			w.published(ctx, BatchResult{Claimed: n})
		}
		if got := w.op == flagBusy; got != c.busy {
			t.Errorf("batch %d, busy rows %d, claims of %v rows %s apart: says busy %v, want %v", c.batch, r.cfg.BusyRows, c.claimed, c.gap, got, c.busy)
		}
	}
}

// A busy relay whose claim comes back empty keeps claiming while the rate
// that made it busy holds (writers commit in waves, one per WAL flush, and
// going to sleep between two waves makes every writer notify until it is
// busy again), and busyLingerClaims times after; then it says "sleep".
func TestBusyRelayLingersWhileTheRateHolds(t *testing.T) {
	ctx := t.Context()
	r := &Relay{listener: &listener{}, cfg: Config{BatchSize: 500, BusyRows: DefaultBusyRows}}
	r.loop.state = saidBusy
	w := r.newWakeup(false)
	for i := range 2 * busyLingerClaims {
		r.loop.recent.add(time.Now(), DefaultBusyRows) // the rate holds
		if w.empty(ctx) || w.op != flagNone {
			t.Fatalf("empty claim %d, %d rows claimed just before: the relay stopped lingering (op %d)", i+1, DefaultBusyRows, w.op)
		}
	}
	time.Sleep(busyWindow + time.Millisecond)
	if w.empty(ctx) || w.op != flagSleep {
		t.Fatalf("no rows for %s after %d empty claims: op %d, want the sleep", busyWindow, w.lingered, w.op)
	}
	if lingerStep(1) != busyLingerStep || lingerStep(busyLingerClaims+1) != 2*busyLingerStep || lingerStep(100) != busyLingerMax {
		t.Errorf("linger steps %s, %s, %s", lingerStep(1), lingerStep(busyLingerClaims+1), lingerStep(100))
	}
}

// Below the rate, a busy relay still lingers busyLingerClaims times before it
// says "sleep": commits arrive in waves, one per WAL flush.
func TestBusyRelayLingersAFewClaimsBelowTheRate(t *testing.T) {
	ctx := t.Context()
	r := &Relay{listener: &listener{}, cfg: Config{BatchSize: 500, BusyRows: DefaultBusyRows}}
	r.loop.state = saidBusy
	w := r.newWakeup(false)
	for i := range busyLingerClaims {
		if w.empty(ctx) || w.op != flagNone {
			t.Fatalf("empty claim %d of a busy relay: op %d, want a linger step first", i+1, w.op)
		}
	}
	if w.empty(ctx) || w.op != flagSleep {
		t.Fatalf("after %d lingers below the rate: op %d, want the sleep", busyLingerClaims, w.op)
	}
}
