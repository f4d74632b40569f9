package relay

import (
	"cmp"
	"testing"
	"time"
)

func TestWakeStateTransitions(t *testing.T) {
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

// A drain tells writers it is busy only when its claims find several
// commits per round trip: at a low rate, two single-row claims in a row
// (a commit landing during the first's publish) must not put the relay in
// the busy state, where each commit waits up to a pace or linger step for
// the next claim. A full batch, however small, is a backlog.
func TestBusyOnlyWithSeveralCommitsPerClaim(t *testing.T) {
	ctx := t.Context()
	for _, c := range []struct {
		batch   int
		claimed []int
		busy    bool
		rows    int // Config.BusyRows (0: the default)
	}{
		{500, []int{1, 1, 1}, false, 0},
		{500, []int{1, DefaultBusyRows - 1}, false, 0},
		{500, []int{1, DefaultBusyRows}, true, 0},
		{500, []int{DefaultBusyRows}, false, 0}, // the first claim of a drain: a wake-up
		{1, []int{1, 1}, true, 0},
		{500, []int{1, 2}, true, 2},
		{500, []int{1, 1}, false, 2},
	} {
		r := &Relay{cfg: Config{BatchSize: c.batch, BusyPace: -1, BusyRows: cmp.Or(c.rows, DefaultBusyRows)}}
		r.listenPID.Store(42)
		w := r.newWakeup(false)
		for _, n := range c.claimed {
			w.sent(BatchResult{Claimed: n}, nil)
			w.published(ctx, BatchResult{Claimed: n})
		}
		if got := w.op == flagBusy; got != c.busy {
			t.Errorf("batch %d, busy rows %d, claims of %v rows: says busy %v, want %v", c.batch, r.cfg.BusyRows, c.claimed, got, c.busy)
		}
	}
}

// A busy relay pauses after a small batch only when asked to (BusyPace): by
// default it claims again at once, since each pause is latency every event
// of the next batch pays.
func TestBusyRelayPacesOnlyWhenAsked(t *testing.T) {
	const pace = 50 * time.Millisecond
	for _, c := range []struct {
		cfg    Config
		paused bool
	}{
		{Config{BatchSize: 500}, false},
		{Config{BatchSize: 500, BusyPace: -1}, false},
		{Config{BatchSize: 500, BusyPace: pace}, true},
	} {
		r := &Relay{cfg: c.cfg.withDefaults()}
		r.state = saidBusy
		w := r.newWakeup(false)
		start := time.Now()
		w.published(t.Context(), BatchResult{Claimed: 1})
		if took := time.Since(start); (took >= pace) != c.paused {
			t.Errorf("busy pace %s: a small batch's publish returned after %s, want a pause of %s: %v", c.cfg.BusyPace, took, pace, c.paused)
		}
	}
}
