package chaos

import (
	"strings"
	"testing"
	"time"
)

// An event's clock starts again at the end of each fault that held it; an
// event that waited longer than its bound after them fails the run.
func TestWaitsAfterFaults(t *testing.T) {
	t0 := time.Date(2026, 12, 6, 5, 0, 0, 0, time.UTC)
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	faults := []FaultRecord{
		{Kind: LongTx, Start: at(1), End: at(3)},
		{Kind: Blackhole, Start: at(10), End: at(14)},
		{Kind: Stall, Start: at(2.5), End: at(4)}, // out of order, overlapping the first
	}
	events := []eventTiming{
		{ID: "calm", Ready: at(0), Publish: at(0.2)},
		{ID: "held", Ready: at(0.5), Publish: at(4.5)},               // 0.5 s after the stall's end
		{ID: "during", Ready: at(1.5), Publish: at(2)},               // published while held: no wait after
		{ID: "late", Ready: at(5), Publish: at(7.5)},                 // no fault: 2.5 s
		{ID: "half-open", Ready: at(11), Publish: at(24)},            // 10 s after the blackhole
		{ID: "half-open-too-late", Ready: at(12), Publish: at(30)},   // 16 s after it
		{ID: "after-half-open", Ready: at(15), Publish: at(22)},      // ready after it ended, held by its after-effect
		{ID: "long-after-half-open", Ready: at(40), Publish: at(43)}, // 3 s, long after it
	}
	got := map[string]afterFault{}
	for _, w := range waitsAfterFaults(events, faults, 0) {
		got[w.event.ID] = w
	}
	for id, want := range map[string]struct {
		wait  time.Duration
		fault int
	}{
		"calm": {200 * time.Millisecond, -1}, "held": {500 * time.Millisecond, 2}, "during": {0, -1},
		"late": {2500 * time.Millisecond, -1}, "half-open": {10 * time.Second, 1}, "half-open-too-late": {16 * time.Second, 1},
		"after-half-open": {7 * time.Second, 1}, "long-after-half-open": {3 * time.Second, -1},
	} {
		if g := got[id]; g.wait != want.wait || (want.wait > 0 && g.fault != want.fault) {
			t.Errorf("%s: wait %s after fault %d, want %s after %d", id, g.wait, g.fault, want.wait, want.fault)
		}
	}

	r := &run{logf: func(string, ...any) {}}
	var res Result
	r.judgeAfterFaults(events, faults, &res)
	if res.WorstAfterFault != 16*time.Second {
		t.Errorf("worst %s, want 16s", res.WorstAfterFault)
	}
	problems := strings.Join(r.problems, "\n")
	if len(r.problems) != 3 || !strings.Contains(problems, "event late ") || !strings.Contains(problems, "event half-open-too-late ") ||
		!strings.Contains(problems, "event long-after-half-open ") {
		t.Errorf("problems:\n%s\nwant the late events and the one past the half-open bound", problems)
	}
}

// A Redis that refused writes for T seconds: the relay's probes' step may
// run up to 2T past the refusals' end (1 s at most), so its events' bound is
// 2 s + min(2T, 1 s).
func TestWaitsAfterARedisThatRefusedWrites(t *testing.T) {
	t0 := time.Date(2026, 12, 7, 5, 0, 0, 0, time.UTC)
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	faults := []FaultRecord{{Kind: RedisOOM, Start: at(10), End: at(14)}}
	events := []eventTiming{
		{ID: "backed-off", Ready: at(11), Publish: at(16.9)}, // 2.9 s after: within 2 s + 1 s
		{ID: "too-late", Ready: at(12), Publish: at(17.2)},   // 3.2 s after
		{ID: "calm-after", Ready: at(30), Publish: at(32.5)}, // no fault: 2.5 s
	}
	r := &run{logf: func(string, ...any) {}}
	var res Result
	r.judgeAfterFaults(events, faults, &res)
	problems := strings.Join(r.problems, "\n")
	if len(r.problems) != 2 || !strings.Contains(problems, "event too-late ") || !strings.Contains(problems, "event calm-after ") ||
		strings.Contains(problems, "event backed-off ") {
		t.Errorf("problems:\n%s\nwant too-late and calm-after only", problems)
	}
}

// Anti-fraud's effects are judged the same way, from the entry in the
// stream (or the effect of the sender's previous event, if later) to the
// effect, with two handovers' reads (4 s) besides when a fault held them: a
// consumer that retried refused effects 5 s apart after a 4 s Redis OOM
// (and 2.5 s more for handovers) fails the run.
func TestEffectWaitsAfterFaults(t *testing.T) {
	t0 := time.Date(2026, 12, 7, 5, 0, 0, 0, time.UTC)
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	faults := []FaultRecord{{Kind: RedisOOM, Start: at(10), End: at(14)}}
	events := []eventTiming{
		{ID: "calm", Key: "a", Seq: 1, Publish: at(1)},
		{ID: "refused", Key: "b", Seq: 2, Publish: at(11)},            // applied at 14.8: 0.8 s after the OOM
		{ID: "held-by-its-sender", Key: "b", Seq: 5, Publish: at(12)}, // behind "refused": 0.1 s after it
		{ID: "backed-off-5s", Key: "c", Seq: 3, Publish: at(12)},      // applied at 18.5: 4.5 s after
		{ID: "no-effect", Key: "d", Seq: 4, Publish: at(2)},
		{ID: "slow-after", Key: "a", Seq: 6, Publish: at(30)}, // no fault: 2.5 s
		{ID: "just-after", Key: "e", Seq: 7, Publish: at(15)}, // 1 s after the OOM: 3.5 s, within 2 + 4 s
	}
	effects := map[string]time.Time{
		"calm": at(1.01), "refused": at(14.8), "held-by-its-sender": at(14.9), "backed-off-5s": at(22.5), "slow-after": at(32.5),
		"just-after": at(18.5),
	}
	timings := effectTimings(events, effects)
	if len(timings) != 6 {
		t.Fatalf("%d effect timings, want 6 (the event without an effect left out): %+v", len(timings), timings)
	}
	got := map[string]afterFault{}
	for _, w := range waitsAfterFaults(timings, faults, consumerHandover) {
		got[w.event.ID] = w
	}
	for id, want := range map[string]time.Duration{
		"calm": 10 * time.Millisecond, "refused": 800 * time.Millisecond, "held-by-its-sender": 100 * time.Millisecond,
		"backed-off-5s": 8500 * time.Millisecond, "slow-after": 2500 * time.Millisecond, "just-after": 3500 * time.Millisecond,
	} {
		if g := got[id].wait; g != want {
			t.Errorf("%s: wait %s, want %s", id, g, want)
		}
	}
	r := &run{logf: func(string, ...any) {}}
	var res Result
	r.judgeEffectsAfterFaults(events, effects, faults, &res)
	problems := strings.Join(r.problems, "\n")
	if len(r.problems) != 2 || !strings.Contains(problems, "event backed-off-5s ") || !strings.Contains(problems, "event slow-after ") ||
		!strings.Contains(problems, "applied") {
		t.Errorf("problems:\n%s\nwant backed-off-5s and slow-after, applied", problems)
	}
	if res.WorstEffectAfterFault != 8500*time.Millisecond {
		t.Errorf("worst %s, want 8.5s", res.WorstEffectAfterFault)
	}
}
