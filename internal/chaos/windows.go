package chaos

import (
	"fmt"
	"sort"
	"strings"
	"time"
)

// calm reports whether no window intersects [t-calmBefore, t+strandedAfter].
func calm(windows []window, t time.Time) bool {
	hi := t.Add(strandedAfter)
	for _, w := range windows {
		if !w.from.After(hi) && !w.to.Add(w.settle).Before(t) {
			return false
		}
	}
	return true
}

// inWindow reports whether t is in some window.
func inWindow(windows []window, t time.Time) bool {
	for _, w := range windows {
		if !t.Before(w.from) && !t.After(w.to) {
			return true
		}
	}
	return false
}

// window is a fault's window; events that commit within settle after it
// are not judged either.
type window struct {
	span
	settle time.Duration
}

// faultWindows returns each fault's window [Start, Back], and before the
// load a window until the relays were back at loadStart.
func faultWindows(faults []FaultRecord, setupBack time.Time) []window {
	ws := []window{{span{time.Time{}, setupBack}, calmBefore}}
	for _, f := range faults {
		ws = append(ws, window{span{f.Start, f.Back}, settleAfter(f.Kind)})
	}
	return ws
}

// settleAfter is how long after a fault's window events are still not
// judged: calmBefore, for what the windows do not model (a pool redialling,
// a backlog draining), except after a busy error, which cuts no connection
// and whose one after-effect, the failed drain's retry, is in the window
// (Back): its backlog is the rows committed during the failed round trip.
// A relay that goes to sleep with writers silent after it strands the
// events committed in the next seconds, and they must be judged.
func settleAfter(kind string) time.Duration {
	if kind == BusyError {
		return busyErrorSettle
	}
	return calmBefore
}

// faultBefore returns the index of the fault whose window ended last at or
// before t, or -1.
func faultBefore(faults []FaultRecord, t time.Time) int {
	prev := -1
	for i, f := range faults {
		if !f.Back.After(t) && (prev < 0 || f.Back.After(faults[prev].Back)) {
			prev = i
		}
	}
	return prev
}

// nearestFaults describes the fault whose window ended last before t and the
// first that started after it.
func nearestFaults(faults []FaultRecord, t time.Time) string {
	prev, next := faultBefore(faults, t), -1
	for i, f := range faults {
		if f.Start.After(t) && (next < 0 || f.Start.Before(faults[next].Start)) {
			next = i
		}
	}
	var parts []string
	if prev >= 0 {
		f := faults[prev]
		parts = append(parts, fmt.Sprintf("after fault #%d %s %s (%s..%s, back %s before the commit)",
			prev+1, f.Kind, f.Detail, stamp(f.Start), stamp(f.Back), t.Sub(f.Back).Round(time.Millisecond)))
	} else {
		parts = append(parts, "no fault before")
	}
	if next >= 0 {
		f := faults[next]
		parts = append(parts, fmt.Sprintf("before fault #%d %s %s (starts %s after the commit)",
			next+1, f.Kind, f.Detail, f.Start.Sub(t).Round(time.Millisecond)))
	} else {
		parts = append(parts, "no fault after")
	}
	return strings.Join(parts, "; ")
}

// calmDuration is how much of [from, to] is outside every window, give or
// take the margins of calm: the time in which a commit would be judged.
func calmDuration(windows []window, from, to time.Time) time.Duration {
	// Widen each window by the margins, then measure what is left.
	ws := make([]span, 0, len(windows))
	for _, w := range windows {
		ws = append(ws, span{w.from.Add(-strandedAfter), w.to.Add(w.settle)})
	}
	sort.Slice(ws, func(i, j int) bool { return ws[i].from.Before(ws[j].from) })
	total, cur := time.Duration(0), from
	for _, w := range ws {
		if !w.from.After(cur) {
			cur = maxTime(cur, w.to)
			continue
		}
		if w.from.After(to) {
			break
		}
		total += w.from.Sub(cur)
		cur = maxTime(cur, w.to)
	}
	if to.After(cur) {
		total += to.Sub(cur)
	}
	return total
}
