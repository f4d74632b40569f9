package chaos

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"
)

// After a fault: no event may wait more than maxAfterFault once
// the faults that held it have ended. An event's clock starts when it is
// ready (eventTiming.Ready: its commit, or its key's previous event's mark)
// and starts again at the End of every fault that began before the event
// was first published and was still going on at that point; what is left
// between the last such start and the first publish is its wait after the
// faults. The stranded analysis (stranded.go) judges calm phases against a
// tighter bound; this judges every event, the ones a fault held included.
//
// A fault's End is when the suite stopped injecting it (a server restarted,
// a process continued, the links thawed, the repair ran), not when the
// relays were back: finding the way back is what is measured.
//
// Half-open links (blackhole) are the exception: a statement or a read
// sent on a connection that went silent waits for its timeout (the relay's
// claim 10 s, a consumer's read its slice + 10 s, consumer/streams.go), which no fault's end
// shortens; they have their own bound, those timeouts and a reconnection.
// So is a Redis that refuses writes (redis-oom) for T seconds: the relay
// backs off while the broker refuses whole batches, probing it with one row
// at steps doubling from 100 ms up to 1 s, each drawn from its upper half
// (docs/design.md: an outage costs a probe per step, not a round per
// commit). A step that began at s, just before the refusals ended, lasts at
// most twice what the steps before it took (at least half each), so the next
// try comes at most 2T after they end, and 1 s: the bound is maxAfterFault +
// min(2T, 1 s).
const (
	maxAfterFault         = 2 * time.Second
	maxAfterHalfOpenFault = 15 * time.Second
	relayBrokerBackoffMax = time.Second // relay/drain.go, brokerRetryMax
)

// afterFaultLimit is the longest an event may wait after f.
func afterFaultLimit(f FaultRecord) time.Duration {
	switch f.Kind {
	case Blackhole:
		return maxAfterHalfOpenFault
	case RedisOOM:
		return maxAfterFault + min(2*max(f.End.Sub(f.Start), 0), relayBrokerBackoffMax)
	}
	return maxAfterFault
}

// afterFault is an event's wait after the faults that held it, the index
// of the last of them (-1: none), and its bound. A half-open link's
// after-effect outlasts the fault (a statement sent on a silent connection
// waits for its timeout): an event ready within maxAfterHalfOpenFault of
// such a fault's end has that bound too, and is counted against it.
type afterFault struct {
	event eventTiming
	wait  time.Duration
	fault int
	limit time.Duration
}

// waitsAfterFaults returns each event's wait after the faults, slowest first;
// held is what the bound of an event gets besides when a fault held it or
// ended less than maxAfterFault before it was ready (what the fault broke
// may still be coming back).
func waitsAfterFaults(events []eventTiming, faults []FaultRecord, held time.Duration) []afterFault {
	order := make([]int, len(faults))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int { return faults[a].Start.Compare(faults[b].Start) })
	out := make([]afterFault, 0, len(events))
	for _, e := range events {
		start, last, limit, halfOpen := e.Ready, -1, maxAfterFault, -1
		recent := -1 // a fault that ended within maxAfterFault before e was ready
		for _, i := range order {
			f := faults[i]
			if !f.Start.Before(e.Publish) {
				break
			}
			if f.End.After(start) {
				start, last = f.End, i
			} else if f.End.Add(maxAfterFault).After(e.Ready) {
				recent = i
			}
			if lim := afterFaultLimit(f); lim > limit && f.End.Add(lim).After(e.Ready) {
				limit, halfOpen = lim, i
			}
		}
		if last < 0 || (halfOpen >= 0 && afterFaultLimit(faults[last]) < limit) {
			last = halfOpen
		}
		if held > 0 {
			if last < 0 {
				last = recent // named as what the effect may still be waiting on
			}
			if last >= 0 {
				limit += held
			}
		}
		out = append(out, afterFault{event: e, wait: max(e.Publish.Sub(start), 0), fault: last, limit: limit})
	}
	slices.SortFunc(out, func(a, b afterFault) int { return int(b.wait - a.wait) })
	return out
}

// judgeAfterFaults reports the events that waited more than their bound
// after their faults before they were published, and the slowest wait of
// each kind of fault.
func (r *run) judgeAfterFaults(events []eventTiming, faults []FaultRecord, res *Result) {
	res.WorstAfterFault = r.judgeWaits(waitsAfterFaults(events, faults, 0), faults, "published")
}

// judgeEffectsAfterFaults does the same for anti-fraud's effects: an
// effect's clock starts when its entry is in the stream (or, if later, when
// the effect of its key's previous event was applied: the consumer holds a
// key's next event until then) and again at the end of every fault in
// force before the effect. The bounds are the events' (a consumer blocked
// on a half-open link waits for its read's timeout, 250 ms + 10 s; one
// whose effects Redis refused retries at most a second apart,
// consumer.MaxRetryDelay), plus, for an effect a fault held or that was
// ready within maxAfterFault of a fault's end, consumerHandover: a fault
// that changes the group's members (a consumer killed, stalled, joining,
// leaving, or cut from Redis) moves partitions, twice when a member comes
// back; after a broker's restart a consumer reopens its partitions, each
// request bounded by 2 s (natssource).
func (r *run) judgeEffectsAfterFaults(events []eventTiming, effects map[string]time.Time, faults []FaultRecord, res *Result) {
	res.WorstEffectAfterFault = r.judgeWaits(waitsAfterFaults(effectTimings(events, effects), faults, consumerHandover), faults, "applied")
}

// consumerHandover is what an effect a fault held may wait besides the
// publish's bound. What it covers: two handovers of its partition (a
// member that comes back takes its partitions back, after others took them
// from it), each a presence tick to notice the change, a read slice for the
// worker to stop and a tick for the new owner (250 ms each,
// consumer/presence.go and streams.go: 1.5 s for two), or a JetStream
// consumer's reopening of its partitions after a server restart (one Open
// that gives up after 2 s, natssource, and its retry). Measured: up to
// 0.9 s after those faults (docs/log.md). It stays 4 s, as before the
// handovers stopped waiting for reads: one auto run had an effect 5.0 s
// after a redis-oom ended (seed 1796652784759724373; its replay: 29 ms),
// unexplained, which 3 s would have failed by less than a second.
const consumerHandover = 4 * time.Second

// effectTimings turns the events that have an effect into timings whose
// Ready is when the consumer could apply them and whose Publish is when it
// did.
func effectTimings(events []eventTiming, effects map[string]time.Time) []eventTiming {
	byKey := slices.Clone(events)
	slices.SortFunc(byKey, func(a, b eventTiming) int {
		if c := strings.Compare(a.Key, b.Key); c != 0 {
			return c
		}
		return cmp.Compare(a.Seq, b.Seq)
	})
	var out []eventTiming
	var prevKey string
	var prevEffect time.Time
	for _, e := range byKey {
		at, ok := effects[e.ID]
		if !ok {
			continue // no verdict: verify reports it
		}
		ready := e.Publish
		if e.Key == prevKey && prevEffect.After(ready) {
			ready = prevEffect
		}
		prevKey, prevEffect = e.Key, at
		out = append(out, eventTiming{ID: e.ID, Commit: e.Commit, Ready: ready, Publish: at, Key: e.Key, Seq: e.Seq})
	}
	return out
}

// judgeWaits reports the waits longer than their bound, says the slowest of
// each kind of fault, and returns the slowest of all; done is what the end
// of a wait is ("published", "applied").
func (r *run) judgeWaits(waits []afterFault, faults []FaultRecord, done string) time.Duration {
	if len(waits) == 0 {
		return 0
	}
	worst := map[string]afterFault{} // the slowest of each kind of fault
	var late []afterFault
	for _, w := range waits {
		kind := "none"
		if w.fault >= 0 {
			kind = faults[w.fault].Kind
		}
		if _, ok := worst[kind]; !ok {
			worst[kind] = w // waits are sorted slowest first
		}
		if w.wait > w.limit {
			late = append(late, w)
		}
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(worst)) {
		w := worst[k]
		parts = append(parts, fmt.Sprintf("%s %s", k, w.wait.Truncate(time.Millisecond)))
		if w.wait > maxAfterFault/2 {
			r.logf("after faults (%s): the slowest, event %s, waited %s (ready %s, %s %s, fault #%d, bound %s)",
				done, w.event.ID, w.wait.Truncate(time.Millisecond), stamp(w.event.Ready), done, stamp(w.event.Publish), w.fault+1, w.limit)
		}
	}
	r.detail("after faults: the slowest wait of an event until %s after the faults that held it ended, by the last of them: %v", done, parts)
	for _, w := range late[:min(len(late), 5)] {
		where := "no fault before it"
		if w.fault >= 0 {
			f := faults[w.fault]
			where = fmt.Sprintf("fault #%d %s %s ended %s", w.fault+1, f.Kind, f.Detail, stamp(f.End))
		}
		r.problem("event %s waited %s after the faults that held it ended (%s; ready %s, %s %s): more than %s",
			w.event.ID, w.wait.Truncate(time.Millisecond), where, stamp(w.event.Ready), done, stamp(w.event.Publish), w.limit)
	}
	if len(late) > 5 {
		r.problem("%d events in all waited longer than their bound until %s after the faults that held them ended", len(late), done)
	}
	return waits[0].wait
}
