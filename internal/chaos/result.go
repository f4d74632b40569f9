package chaos

import (
	"cmp"
	"fmt"
	"strings"
	"time"
)

// FaultRecord is one injected fault.
type FaultRecord struct {
	Kind     string
	Detail   string
	Start    time.Time
	End      time.Time     // when the fault stopped being injected
	Recovery time.Duration // from End until the pipeline caught up (-1: never)
	// Back: when the relays' wake-up path was back after the fault; the
	// fault's window in the stranded analysis is [Start, Back] (stranded.go).
	Back time.Time
	// UnderLoad: settle was still producing TEDs when the fault began.
	UnderLoad bool
	Note      string
	// Kills: Group is the kind of process killed (relay, fraud, ledger),
	// Survivors how many of its group were left running (failover.go).
	Group     string
	Survivors int
}

// Result is what a run found.
type Result struct {
	Seed                           uint64
	Transfers, Events, Verdicts    int
	Lost, Doubled                  int
	Faults                         []FaultRecord
	MaxRecovery                    time.Duration
	Duration                       time.Duration
	Problems                       []string // every failed check; empty means the run passed
	Details                        []string // diagnostics worth printing
	StreamEntries, DuplicatesInRed int
	// Stranded events (stranded.go): of the Judged events, committed in
	// calm phases, how many were published more than a second after their
	// commit, and the longest commit-to-publish delay among them.
	Judged, Stranded int
	WorstCalm        time.Duration
	// WorstAfterFault: the longest an event waited after the faults that
	// held it ended (afterfault.go); over maxAfterFault fails the run.
	WorstAfterFault time.Duration
	// WorstEffectAfterFault: the same for anti-fraud's effects, from the
	// entry in the stream to the effect (afterfault.go).
	WorstEffectAfterFault time.Duration
	// Restarts counts the relays restarted gracefully by rolling deploys.
	Restarts int
	// Probes counts the hand-over probes (probe.go); ProbesExact those in
	// which the other relays slept throughout, so that only the stopping
	// relay's hand-over could publish the probe's TED in time.
	Probes, ProbesExact int
	// Cluster: the run was on a Redis Cluster; OutOfOrder counts the
	// senders whose effects the audit shows applied out of settled order.
	Cluster    bool
	OutOfOrder int
	// Ownership: the relays' --ownership.
	Ownership string
	// NATS: the run was on NATS JetStream.
	NATS bool
	// Failover: what each kind of fault cost the events committed while it
	// was in force (failover.go).
	Failover []FailoverCost
	// CalmEffectP99: commit → effect in calm phases, the failover bound's
	// baseline.
	CalmEffectP99 time.Duration
}

// kinds is the fault kinds of the run's mode.
func (r Result) kinds() []string {
	switch {
	case r.Cluster:
		return ClusterKinds
	case r.NATS:
		return NATSKinds
	}
	return Kinds
}

// mustFire is the kinds of fault that test something only when they fire:
// a fail point needs traffic through its point, a busy error a relay in
// the busy state, a Redis refusing writes a relay publishing to it. Their
// notes start with "fired" when they did.
var mustFire = []string{Failpoint, BusyError, RedisOOM}

// unfired reports each kind of mustFire injected while the load ran of
// which not one fired: such a run passes while testing less than it says
// (as when the chaos load stopped reaching the relays' busy state).
func (r Result) unfired() []string {
	var out []string
	for _, k := range mustFire {
		tried, fired := 0, 0
		for _, f := range r.Faults {
			if f.Kind != k || !f.UnderLoad {
				continue
			}
			tried++
			if strings.HasPrefix(f.Note, "fired") {
				fired++
			}
		}
		if tried > 0 && fired == 0 {
			out = append(out, fmt.Sprintf("none of the %d %s faults injected under load fired: the run did not test them", tried, k))
		}
	}
	return out
}

// Summary is the one line a run prints.
func (r Result) Summary() string {
	counts := map[string]int{}
	for _, f := range r.Faults {
		counts[f.Kind]++
	}
	var fs []string
	for _, k := range r.kinds() {
		fs = append(fs, fmt.Sprintf("%s:%d", k, counts[k]))
	}
	mode := "single"
	switch {
	case r.Cluster:
		mode = "cluster"
	case r.NATS:
		mode = "nats"
	}
	// New fields go at the end: scripts read this line.
	return fmt.Sprintf("chaos: seed=%d transfers=%d events=%d verdicts=%d lost=%d doubled=%d stranded=%d judged=%d worst_calm_ms=%d faults=%s restarts=%d probes=%d/%d max_recovery=%.1fs duration=%.0fs out_of_order=%d mode=%s ownership=%s worst_after_fault_ms=%d worst_effect_after_fault_ms=%d",
		r.Seed, r.Transfers, r.Events, r.Verdicts, r.Lost, r.Doubled, r.Stranded, r.Judged, r.WorstCalm.Milliseconds(), strings.Join(fs, ","),
		r.Restarts, r.ProbesExact, r.Probes, r.MaxRecovery.Seconds(), r.Duration.Seconds(), r.OutOfOrder, mode, cmp.Or(r.Ownership, "auto"), r.WorstAfterFault.Milliseconds(),
		r.WorstEffectAfterFault.Milliseconds())
}

// ByKind summarizes the faults per kind: how many, how many while the load
// was running, and the longest recovery.
func (r Result) ByKind() []string {
	type agg struct {
		n, underLoad int
		maxRec       time.Duration
		never        int
	}
	m := map[string]*agg{}
	for _, f := range r.Faults {
		a := m[f.Kind]
		if a == nil {
			a = &agg{}
			m[f.Kind] = a
		}
		a.n++
		if f.UnderLoad {
			a.underLoad++
		}
		if f.Recovery < 0 {
			a.never++
		}
		a.maxRec = max(a.maxRec, f.Recovery)
	}
	var out []string
	for _, k := range r.kinds() {
		a := m[k]
		if a == nil {
			out = append(out, fmt.Sprintf("%-17s 0", k))
			continue
		}
		out = append(out, fmt.Sprintf("%-17s %3d injected, %3d under load, max recovery %5.1fs, never recovered %d", k, a.n, a.underLoad, a.maxRec.Seconds(), a.never))
	}
	return out
}
