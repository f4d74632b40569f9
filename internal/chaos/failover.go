package chaos

import (
	"context"
	"fmt"
	"slices"
	"time"
)

// Failover: what each fault cost the events committed while it was in
// force, as the slowest commit → stream delay (the relays' part) and the
// slowest commit → effect delay (anti-fraud's, from its audit streams, whose
// entry ids say when each effect was applied).
//
// An event counts for a fault when it committed in [Start-failoverBefore,
// End+failoverAfter] (the second before a kill: the batch a killed relay or
// consumer held) and waited, until its stream entry or its effect, through
// no other fault's window (stranded.go's [Start, Back]; faultCost). The run fails when a kill that left a survivor in its
// group cost more than the failover bounds: a relay's death, maxRelayFailover
// from commit to stream; an anti-fraud consumer's, maxConsumerFailover from
// commit to effect beyond what calm phases cost (the 99th percentile of
// commit → effect among the events committed in no fault's window,
// consumersCalm: under
// the suite's load on two cores, anti-fraud alone lags by a second or two
// now and then, and that is not the kill's). Kills of a whole group wait for the supervisor's restart
// and are reported, not bounded; so are the ledger's (its flaky accounts hold
// postings back for seconds on purpose) and every other kind of fault.
const (
	failoverBefore      = time.Second
	failoverAfter       = time.Second
	maxRelayFailover    = 2 * time.Second
	maxConsumerFailover = 3 * time.Second
)

// FailoverCost is what the faults of one kind cost (Result.Failover).
type FailoverCost struct {
	Kind   string
	Faults int
	// Stream and Effect are the slowest commit → stream and commit → effect
	// delays among the events those faults touched; StreamEvent and
	// EffectEvent the events, StreamFault and EffectFault the faults (1-based).
	Stream, Effect           time.Duration
	StreamEvent, EffectEvent string
	StreamFault, EffectFault int
}

func (c FailoverCost) String() string {
	return fmt.Sprintf("%s: %d faults, slowest commit→stream %s (event %s, fault #%d), commit→effect %s (event %s, fault #%d)",
		c.Kind, c.Faults, c.Stream.Truncate(time.Millisecond), c.StreamEvent, c.StreamFault,
		c.Effect.Truncate(time.Millisecond), c.EffectEvent, c.EffectFault)
}

// failover fills res.Failover and checks the kills' bounds. It runs after
// stranded, which set every fault's Back.
func (r *run) failover(ctx context.Context, res *Result) {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	events, err := r.eventTimings(ctx)
	if err != nil {
		r.problem("failover analysis: read events: %v", err)
		return
	}
	effects, err := r.effectTimes(ctx)
	if err != nil {
		r.problem("failover analysis: read the audit streams: %v", err)
		return
	}
	r.mu.Lock()
	faults := slices.Clone(r.faults)
	r.mu.Unlock()
	var calm []time.Duration
	for _, e := range events {
		if at, ok := effects[e.ID]; ok && consumersCalm(faults, e.Commit) {
			calm = append(calm, at.Sub(e.Commit))
		}
	}
	slices.Sort(calm)
	var calmP99 time.Duration
	if len(calm) > 0 {
		calmP99 = calm[min(len(calm)-1, len(calm)*99/100)]
		r.detail("failover baseline: commit → effect in calm phases, %d events: p50 %s, p99 %s, max %s", len(calm),
			calm[len(calm)/2].Truncate(time.Millisecond), calmP99.Truncate(time.Millisecond), calm[len(calm)-1].Truncate(time.Millisecond))
	}
	res.CalmEffectP99 = calmP99
	r.judgeEffectsAfterFaults(events, effects, faults, res)
	costs := map[string]*FailoverCost{}
	var order []string
	for i, f := range faults {
		c := costs[f.Kind]
		if c == nil {
			c = &FailoverCost{Kind: f.Kind}
			costs[f.Kind] = c
			order = append(order, f.Kind)
		}
		c.Faults++
		stream, streamEv, effect, effectEv := faultCost(faults, i, events, effects)
		if stream > c.Stream {
			c.Stream, c.StreamEvent, c.StreamFault = stream, streamEv, i+1
		}
		if effect > c.Effect {
			c.Effect, c.EffectEvent, c.EffectFault = effect, effectEv, i+1
		}
		switch {
		case f.Survivors == 0:
		case f.Kind == KillRelay && stream > maxRelayFailover:
			r.problem("fault #%d %s %s cost event %s %s from commit to stream: more than a relay's failover bound %s",
				i+1, f.Kind, f.Detail, streamEv, stream.Truncate(time.Millisecond), maxRelayFailover)
		case f.Kind == KillConsumer && f.Group == "fraud" && effect > maxConsumerFailover+calmP99:
			r.problem("fault #%d %s %s cost event %s %s from commit to effect: more than a consumer's failover bound %s beyond the calm phases' p99 %s",
				i+1, f.Kind, f.Detail, effectEv, effect.Truncate(time.Millisecond), maxConsumerFailover, calmP99.Truncate(time.Millisecond))
		}
	}
	for _, k := range order {
		res.Failover = append(res.Failover, *costs[k])
		r.detail("failover %s", costs[k])
	}
}

// consumersCalm: t is outside every fault's window as the consumers live it:
// from a second before its Start until a second after the pipeline caught
// up (End + Recovery, every TED committed by End judged) or the relays were
// back, whichever is later. (The relays' windows alone end while a consumer
// may still wait out a read deadline after a Redis fault.)
func consumersCalm(faults []FaultRecord, t time.Time) bool {
	for _, f := range faults {
		end := maxTime(f.Back, f.End.Add(max(f.Recovery, 0)))
		if f.Recovery < 0 {
			end = forever
		}
		if !t.Before(f.Start.Add(-failoverBefore)) && t.Before(end.Add(failoverAfter)) {
			return false
		}
	}
	return true
}

// faultCost is the slowest commit → stream and commit → effect delay among
// the events the i-th fault touched: committed in [Start-failoverBefore,
// End+failoverAfter] and in no other fault's window. A wait that runs into
// another fault's window is charged only up to that window's start: an
// event committed just before another fault began and held up by it (a
// Redis master killed half a second after a consumer) is the other fault's
// cost from then on, and a slow failover still shows, up to there.
func faultCost(faults []FaultRecord, i int, events []eventTiming, effects map[string]time.Time) (
	stream time.Duration, streamEv string, effect time.Duration, effectEv string) {
	f := faults[i]
	from, to := f.Start.Add(-failoverBefore), f.End.Add(failoverAfter)
	for _, e := range events {
		if e.Commit.Before(from) || !e.Commit.Before(to) {
			continue
		}
		if d := chargedUntil(faults, i, e.Commit, e.Publish).Sub(maxTime(e.Commit, e.Ready)); d > stream {
			stream, streamEv = d, e.ID
		}
		if at, ok := effects[e.ID]; ok {
			if d := chargedUntil(faults, i, e.Commit, at).Sub(e.Commit); d > effect {
				effect, effectEv = d, e.ID
			}
		}
	}
	return stream, streamEv, effect, effectEv
}

// chargedUntil is until when a wait from from to to is the i-th fault's: to,
// or the start of the first other fault's window [Start, Back] it meets
// (from itself when from is inside one).
func chargedUntil(faults []FaultRecord, i int, from, to time.Time) time.Time {
	until := to
	for j, f := range faults {
		if j == i || to.Before(f.Start) || from.After(maxTime(f.Back, f.End)) {
			continue
		}
		until = minTime(until, maxTime(f.Start, from))
	}
	return until
}

// effectTimes reads when anti-fraud applied each event: the time of its
// first entry in the audit streams.
func (r *run) effectTimes(ctx context.Context) (map[string]time.Time, error) {
	out := map[string]time.Time{}
	for _, k := range r.fraudKeys().Each() {
		start := "-"
		for {
			msgs, err := r.rdb.XRangeN(ctx, k.Audit(), start, "+", 1000).Result()
			if err != nil {
				return nil, err
			}
			for _, m := range msgs {
				id, _ := m.Values["event_id"].(string)
				if at, ok := entryTime(m.ID); ok && id != "" {
					if prev, seen := out[id]; !seen || at.Before(prev) {
						out[id] = at
					}
				}
			}
			if len(msgs) < 1000 {
				break
			}
			start = "(" + msgs[len(msgs)-1].ID
		}
	}
	return out, nil
}
