package chaos

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"testing"
	"time"
)

var t0 = time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)

func at(d time.Duration) time.Time { return t0.Add(d) }

const ms = time.Millisecond

// relayLog writes a log the way the supervisor and the relay's text handler
// do, with controlled times.
type relayLog struct {
	buf  bytes.Buffer
	now  time.Time
	log  *slog.Logger
	name string
}

func newRelayLog(name string) *relayLog {
	l := &relayLog{name: name}
	h := slog.NewTextHandler(&l.buf, &slog.HandlerOptions{Level: slog.LevelDebug,
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			if a.Key == slog.TimeKey {
				a.Value = slog.TimeValue(l.now)
			}
			return a
		}})
	l.log = slog.New(h).With(slog.String("relay", name))
	return l
}

func (l *relayLog) start(n int, d time.Duration) {
	fmt.Fprintf(&l.buf, "=== chaos: start %s #%d OUTBOX_FAILPOINTS=\"\" at %s\n", l.name, n, stamp(at(d)))
}

func (l *relayLog) ended(n int) {
	fmt.Fprintf(&l.buf, "=== chaos: %s #%d ended (killed: signal: killed) after 1.5s\n", l.name, n)
}

func (l *relayLog) line(d time.Duration, level slog.Level, msg string, args ...any) {
	l.now = at(d)
	l.log.Log(context.Background(), level, msg, args...)
}

func (l *relayLog) started(d time.Duration) {
	l.line(d, slog.LevelInfo, "relay starting", "batch", 500, "lease", 5*time.Second, "poll", 5*time.Second)
}

func (l *relayLog) listening(d time.Duration) {
	l.line(d, slog.LevelDebug, "listening", "channel", "outbox_messages")
}

// reestablished logs a LISTEN connection back after failed tries.
func (l *relayLog) reestablished(d time.Duration) {
	l.line(d, slog.LevelInfo, "listen connection re-established", "channel", "outbox_messages", "failed_attempts", 2)
}

func (l *relayLog) listenLost(d, retry time.Duration) {
	l.line(d, slog.LevelWarn, "listen connection lost; reconnecting", "error", errors.New(`ping: write tcp 127.0.0.1:1->127.0.0.1:2: i/o timeout`),
		"attempt", 1, "retry_in", retry)
}

// backoff logs a publish round Redis refused: at once (OOM), or after the
// publish timed out.
func (l *relayLog) backoff(d, retry time.Duration, timedOut bool) {
	err := errors.New("OOM command not allowed when used memory > 'maxmemory'.")
	if timedOut {
		err = errors.New("read tcp 127.0.0.1:60236->127.0.0.1:39109: i/o timeout")
	}
	l.line(d, slog.LevelWarn, "redis unavailable; backing off", "released", 3, "retry_in", retry, "error", err)
}

// drainFailed logs a failed drain: at once (connection refused), or after
// the claim timed out.
func (l *relayLog) drainFailed(d time.Duration, timedOut bool) {
	err := errors.New("claim: failed to connect to `user=postgres database=chaos`: 127.0.0.1:45165 (127.0.0.1): dial error: connect: connection refused")
	if timedOut {
		err = errors.New("claim: timeout: context deadline exceeded")
	}
	l.line(d, slog.LevelWarn, "drain failed; retrying", "error", err, "retry_in", time.Second)
}

func TestParseRelayLog(t *testing.T) {
	l := newRelayLog("r1")
	l.start(1, 0)
	l.started(10 * ms)
	l.listening(20 * ms)
	l.line(30*ms, slog.LevelDebug, "go-redis: something with msg=listening in it")
	l.backoff(2*time.Second, 400*ms, true)
	l.ended(1)
	l.start(2, 3*time.Second)
	l.listenLost(4*time.Second, 200*ms)
	l.reestablished(4300 * ms)
	got := parseRelayLog(l.buf.Bytes())
	if len(got[1]) != 2 || len(got[2]) != 2 {
		t.Fatalf("events by incarnation: %+v\nlog:\n%s", got, l.buf.String())
	}
	want := []logEvent{{at(20 * ms), evListening, 0, false}, {at(2 * time.Second), evBackoff, 400 * ms, true}}
	for i, e := range got[1] {
		if e != want[i] {
			t.Errorf("incarnation 1 event %d = %+v, want %+v", i, e, want[i])
		}
	}
	if e := got[2][0]; e.msg != evListenLost || e.retryIn != 200*ms || !e.at.Equal(at(4*time.Second)) || !e.hung {
		t.Errorf("incarnation 2 event 0 = %+v", e)
	}
	if e := got[2][1]; e.msg != evListening || !e.at.Equal(at(4300*ms)) {
		t.Errorf("incarnation 2 event 1 (re-established after failed tries) = %+v, want %q", e, evListening)
	}
}

// The timeline of one relay: killed and restarted, a Redis backoff, a lost
// LISTEN connection, back after failed tries.
func TestBuildTimeline(t *testing.T) {
	l := newRelayLog("r1")
	l.start(1, 0)
	l.listening(100 * ms)
	l.backoff(5*time.Second, 800*ms, true) // the publish hung 2.5s before
	l.backoff(7*time.Second, 300*ms, false)
	l.ended(1)
	l.start(2, 10200*ms)
	l.listening(11 * time.Second)
	l.listenLost(20*time.Second, 100*ms)
	l.reestablished(21 * time.Second)
	l.drainFailed(40*time.Second, true) // the claim hung 10s before
	l.drainFailed(45*time.Second, false)
	l.ended(2) // stopped for good at the end of the run
	incs := []incarnation{{at(0), at(10 * time.Second)}, {at(10200 * ms), at(50 * time.Second)}}
	tl := buildTimeline("r1", incs, parseRelayLog(l.buf.Bytes()))

	impaired := func(d time.Duration) bool {
		for _, s := range tl.impaired {
			if s.contains(at(d)) {
				return true
			}
		}
		return false
	}
	for _, c := range []struct {
		d    time.Duration
		want bool
	}{
		{50 * ms, true}, // started, LISTEN not yet up
		{100 * ms, false},
		{2 * time.Second, false},
		{2600 * ms, true}, // the publish that failed at 5s may have hung since 2.5s
		{5700 * ms, true},
		{5800 * ms, false},
		{6900 * ms, false}, // OOM: refused at once
		{7100 * ms, true},
		{7300 * ms, false},
		{10100 * ms, true}, // killed, not yet restarted
		{10500 * ms, true}, // restarted, LISTEN not yet up
		{11 * time.Second, false},
		{20500 * ms, true}, // LISTEN lost
		{21 * time.Second, false},
		{29 * time.Second, false},
		{30500 * ms, true}, // the failed drain's claim may have hung since 30s
		{40500 * ms, true}, // retrying it
		{41 * time.Second, false},
		{44900 * ms, false}, // connection refused at once
		{45500 * ms, true},
		{46 * time.Second, false},
		{50 * time.Second, false}, // the run is over
		{time.Hour, false},
	} {
		if got := impaired(c.d); got != c.want {
			t.Errorf("impaired at +%s = %v, want %v (spans %v)", c.d, got, c.want, tl.impaired)
		}
	}
	if len(tl.listening) != 3 || !tl.listenAfter(at(12*time.Second)).Equal(at(21*time.Second)) || !tl.listenAfter(at(22*time.Second)).Equal(forever) {
		t.Errorf("listening %v", tl.listening)
	}
}

func TestBackTime(t *testing.T) {
	// Out of order, so that one pass over them is not enough.
	spans := []span{{at(1400 * ms), at(1600 * ms)}, {at(2 * time.Second), at(3 * time.Second)}, {at(0), at(1500 * ms)}}
	// From 1s: in [0,1.5), then [1.4,1.6) chains; [2,3) is not reached.
	if got, capped := backTime(at(time.Second), spans, time.Minute); !got.Equal(at(1600*ms)) || capped {
		t.Errorf("back = %s capped %v, want +1.6s", got.Sub(t0), capped)
	}
	if got, _ := backTime(at(1700*ms), spans, time.Minute); !got.Equal(at(1700 * ms)) {
		t.Errorf("back from a calm instant = %s, want itself", got.Sub(t0))
	}
	if got, capped := backTime(at(time.Second), []span{{at(0), forever}}, 10*time.Second); !got.Equal(at(11*time.Second)) || !capped {
		t.Errorf("back = %s capped %v, want the cap", got.Sub(t0), capped)
	}
}

// The window of each kind of fault.
func TestFaultBack(t *testing.T) {
	s := 100 * time.Second
	healthy := func(name string) relayTimeline {
		return relayTimeline{name: name, listening: []time.Time{at(time.Second)}}
	}
	// r1 SIGKILLed at s, restarted 300ms later, LISTEN up 900ms after s.
	killed := relayTimeline{name: "r1",
		impaired:  []span{{at(s + 5*ms), at(s + 300*ms)}, {at(s + 300*ms), at(s + 900*ms)}},
		listening: []time.Time{at(time.Second), at(s + 900*ms)}}
	kill := FaultRecord{Kind: KillRelay, Detail: "r1", Start: at(s), End: at(s + 10*ms)}
	if got, _ := faultBack(kill, []relayTimeline{killed, healthy("r2")}); !got.Equal(at(s + 900*ms)) {
		t.Errorf("kill-relay: back at %s, want when the replacement listens (+900ms)", got.Sub(at(s)))
	}

	// A blackhole of PostgreSQL: the relays log nothing until the ping of
	// their half-open LISTEN connection fails 20s later; they LISTEN again
	// at +20.2s and +21s.
	halfOpen := func(name string, lost, up time.Duration) relayTimeline {
		return relayTimeline{name: name, impaired: []span{{at(s + lost), at(s + up)}},
			listening: []time.Time{at(time.Second), at(s + up)}}
	}
	relays := []relayTimeline{halfOpen("r1", 20*time.Second, 20200*ms), halfOpen("r2", 21*time.Second, 21*time.Second)}
	bh := FaultRecord{Kind: Blackhole, Detail: "pg", Start: at(s), End: at(s + 4*time.Second)}
	if got, _ := faultBack(bh, relays); !got.Equal(at(s + 21*time.Second)) {
		t.Errorf("blackhole pg: back at +%s, want when the last relay listens again (+21s)", got.Sub(at(s)))
	}
	// A LISTEN established during the blackhole is frozen too: it does not count.
	during := relayTimeline{name: "r1", listening: []time.Time{at(time.Second), at(s + 2*time.Second), at(s + 25*time.Second)}}
	if got, _ := faultBack(bh, []relayTimeline{during}); !got.Equal(at(s + 25*time.Second)) {
		t.Errorf("blackhole pg: back at +%s, want +25s", got.Sub(at(s)))
	}
	// The same relays after a blackhole of Redis only: LISTEN is not cut.
	bhr := FaultRecord{Kind: Blackhole, Detail: "redis", Start: at(s), End: at(s + 4*time.Second)}
	if got, _ := faultBack(bhr, []relayTimeline{healthy("r1"), healthy("r2")}); !got.Equal(bhr.End) {
		t.Errorf("blackhole redis: back at +%s, want the end of the fault", got.Sub(at(s)))
	}
	// Redis OOM: a relay backing off past the end of the fault.
	backingOff := relayTimeline{name: "r2", impaired: []span{{at(s + 3*time.Second), at(s + 9*time.Second)}}, listening: []time.Time{at(time.Second)}}
	oom := FaultRecord{Kind: RedisOOM, Start: at(s), End: at(s + 8*time.Second)}
	if got, _ := faultBack(oom, []relayTimeline{healthy("r1"), backingOff}); !got.Equal(at(s + 9*time.Second)) {
		t.Errorf("redis-oom: back at +%s, want the end of the backoff (+9s)", got.Sub(at(s)))
	}
	// A relay that never listens again after a pg-terminate: capped.
	term := FaultRecord{Kind: PGTerminate, Start: at(s), End: at(s + 5*ms)}
	if got, capped := faultBack(term, []relayTimeline{healthy("r1")}); !capped || !got.Equal(term.End.Add(backLimit)) {
		t.Errorf("pg-terminate without a new LISTEN: back at +%s capped %v, want the cap", got.Sub(at(s)), capped)
	}
	// A consumer fault does not touch the relays.
	kc := FaultRecord{Kind: KillConsumer, Start: at(s), End: at(s + 5*ms)}
	if got, _ := faultBack(kc, []relayTimeline{healthy("r1"), healthy("r2")}); !got.Equal(kc.End) {
		t.Errorf("kill-consumer: back at +%s, want its end", got.Sub(at(s)))
	}
}

func TestClassify(t *testing.T) {
	// One fault window, [10s, 12s].
	faults := []FaultRecord{{Kind: KillRelay, Detail: "r2", Start: at(10 * time.Second), End: at(10*time.Second + 5*ms), Back: at(12 * time.Second)}}
	windows := faultWindows(faults, at(time.Second))
	ev := func(id string, commit, delay time.Duration) eventTiming {
		return eventTiming{ID: id, Commit: at(commit), Publish: at(commit + delay)}
	}
	events := []eventTiming{
		ev("setup", 2500*ms, 3*time.Second),      // within 2s of the set-up window: not judged
		ev("fast", 5*time.Second, 20*ms),         // calm, fast
		ev("slow", 6*time.Second, 4*time.Second), // calm, stranded
		ev("edge", 7*time.Second, time.Second),   // exactly 1s: not stranded
		ev("before", 9100*ms, 5*time.Second),     // fault starts within 1s of the commit: not judged
		ev("calm-before", 8900*ms, 1100*ms),      // fault starts 1.1s after: judged, stranded
		ev("during", 11*time.Second, 3*time.Second),
		ev("after", 13900*ms, 3*time.Second), // 1.9s after the window: not judged
		ev("late", 14100*ms, 1500*ms),        // 2.1s after: judged, stranded
		ev("worst-unjudged", 11500*ms, time.Minute),
	}
	rep := classify(events, windows)
	var ids []string
	for _, e := range rep.Stranded {
		ids = append(ids, e.ID)
	}
	if fmt.Sprint(ids) != "[slow calm-before late]" {
		t.Errorf("stranded %v, want [slow calm-before late]", ids)
	}
	if rep.Judged != 5 {
		t.Errorf("judged %d, want 5 (fast slow edge calm-before late)", rep.Judged)
	}
	// setup, before, after: outside the windows, within the margins.
	if rep.Margin != 3 || rep.MarginWorst.ID != "before" {
		t.Errorf("margin %d, slowest %s; want 3, before", rep.Margin, rep.MarginWorst.ID)
	}
	if rep.Worst.ID != "slow" || rep.Worst.delay() != 4*time.Second {
		t.Errorf("worst %s %s, want slow 4s", rep.Worst.ID, rep.Worst.delay())
	}
	if got := nearestFaults(faults, at(14100*ms)); got != "after fault #1 kill-relay r2 (12:00:10.000..12:00:12.000, back 2.1s before the commit); no fault after" {
		t.Errorf("nearest faults: %s", got)
	}
	if got := calmDuration(windows, at(0), at(20*time.Second)); got != 20*time.Second-(3*time.Second+(14-9)*time.Second) {
		// [0, 1s] widened to [-1s, 3s], [10s, 12s] to [9s, 14s]
		t.Errorf("calm duration %s, want 12s", got)
	}
}

// An event whose key's previous event was still unpublished when it
// committed (a killed relay held it until its lease ran out) is timed from
// that event's mark: the claim's gate held it, not a missing wake-up.
func TestEventsHeldByTheirKeysPredecessorAreTimedFromIt(t *testing.T) {
	held := eventTiming{ID: "held", Commit: at(5 * time.Second), Ready: at(8 * time.Second), Publish: at(8*time.Second + 30*ms)}
	late := eventTiming{ID: "late", Commit: at(5 * time.Second), Ready: at(8 * time.Second), Publish: at(9500 * ms)}
	rep := classify([]eventTiming{held, late}, nil)
	if rep.Judged != 2 || len(rep.Stranded) != 1 || rep.Stranded[0].ID != "late" {
		t.Fatalf("judged %d, stranded %v; want 2 judged and only late stranded", rep.Judged, rep.Stranded)
	}
	if held.delay() != 30*ms {
		t.Fatalf("held: delay %s, want 30ms from its predecessor's mark", held.delay())
	}
}

// After a busy error, events are judged busyErrorSettle after its window,
// not calmBefore: a relay that sleeps with writers silent strands the next
// seconds' events, which must not be excused.
func TestBusyErrorSettlesQuickly(t *testing.T) {
	for _, tc := range []struct {
		kind   string
		judged int
	}{{BusyError, 1}, {KillRelay, 0}} {
		faults := []FaultRecord{{Kind: tc.kind, Start: at(10 * time.Second), End: at(10500 * ms), Back: at(10600 * ms)}}
		events := []eventTiming{{ID: "next", Commit: at(11 * time.Second), Publish: at(14 * time.Second)}}
		rep := classify(events, faultWindows(faults, at(time.Second)))
		if rep.Judged != tc.judged || len(rep.Stranded) != tc.judged {
			t.Errorf("%s: an event 400ms after the window: judged %d, stranded %d; want %d", tc.kind, rep.Judged, len(rep.Stranded), tc.judged)
		}
	}
}

func TestEntryTime(t *testing.T) {
	if got, ok := entryTime("1740830400123-7"); !ok || !got.Equal(time.UnixMilli(1740830400123)) {
		t.Errorf("entryTime = %v %v", got, ok)
	}
	for _, bad := range []string{"", "x-1", "123"} {
		if _, ok := entryTime(bad); ok {
			t.Errorf("entryTime(%q) ok", bad)
		}
	}
}
