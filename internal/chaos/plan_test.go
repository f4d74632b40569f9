package chaos

import (
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tedbank/outbox/fraud"
)

// Every run, short or not, injects every kind of fault and every fail point,
// with the busy errors, rolling deploys, the measured failovers (one relay,
// one consumer killed) and fail points first (they only matter while events
// flow).
func TestMandatoryFaultsCoverEveryKind(t *testing.T) {
	for _, short := range []bool{true, false} {
		r := &run{cfg: Config{Short: short}, rng: rand.New(rand.NewPCG(7, 7))}
		plan := r.mandatory()
		kinds := map[string]bool{}
		var fps []string
		for i, f := range plan {
			kinds[f.kind] = true
			if f.kind == Failpoint {
				fps = append(fps, f.variant)
			}
			killOne := (f.kind == KillRelay || f.kind == KillConsumer) && f.variant == killOne
			data := f.kind == BigPayloads || f.kind == LongTx || f.kind == RedisLoss
			early := f.kind == Failpoint || f.kind == BusyError || f.kind == RollingDeploy || killOne || f.kind == Stall || data
			if first := len(Failpoints) + 11; early && i >= first {
				t.Errorf("short=%v: %s %s at position %d, after other faults", short, f.kind, f.variant, i)
			}
		}
		for _, k := range append(slices.Clone(Kinds), RollingDeploy) {
			if !kinds[k] {
				t.Errorf("short=%v: no %s in the mandatory faults %v", short, k, plan)
			}
		}
		slices.Sort(fps)
		want := slices.Sorted(slices.Values(Failpoints))
		if !slices.Equal(fps, want) {
			t.Errorf("short=%v: fail points %v, want each of %v once", short, fps, want)
		}
	}
}

// The same seed gives the same schedule.
func TestScheduleIsReplayableFromTheSeed(t *testing.T) {
	draw := func(seed uint64) []planned {
		r := &run{cfg: Config{Seed: seed}, rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
		plan := r.mandatory()
		for range 50 {
			plan = append(plan, r.random())
		}
		return plan
	}
	if a, b := draw(42), draw(42); !slices.Equal(a, b) {
		t.Fatalf("seed 42 gave two schedules:\n%v\n%v", a, b)
	}
	if a, b := draw(42), draw(43); slices.Equal(a, b) {
		t.Fatal("seeds 42 and 43 gave the same schedule")
	}
	for _, f := range draw(1) {
		if !slices.Contains(Kinds, f.kind) && f.kind != RollingDeploy {
			t.Errorf("unknown kind %q", f.kind)
		}
	}
}

func TestSummaryLine(t *testing.T) {
	res := Result{Seed: 9, Transfers: 10, Events: 10, Verdicts: 10, Judged: 8, Stranded: 1, WorstCalm: 5012 * time.Millisecond, MaxRecovery: 1500 * time.Millisecond, Duration: 61 * time.Second,
		Faults: []FaultRecord{{Kind: KillRelay}, {Kind: KillRelay}, {Kind: RedisOOM}, {Kind: BusyError}}, Restarts: 4}
	got := res.Summary()
	want := "chaos: seed=9 transfers=10 events=10 verdicts=10 lost=0 doubled=0 stranded=1 judged=8 worst_calm_ms=5012 faults=kill-relay:2,kill-consumer:0,failpoint:0," +
		"pg-terminate:0,redis-client-kill:0,blackhole:0,pg-restart:0,redis-kill:0,redis-oom:1,busy-error:1,stall:0,pg-flap:0,big-payloads:0,long-tx:0,redis-loss:0 restarts=4 probes=0/0 max_recovery=1.5s duration=61s" +
		" out_of_order=0 mode=single ownership=auto worst_after_fault_ms=0 worst_effect_after_fault_ms=0"
	if got != want {
		t.Errorf("summary\n got %s\nwant %s", got, want)
	}
	if lines := res.ByKind(); len(lines) != len(Kinds) || !strings.HasPrefix(lines[0], "kill-relay") {
		t.Errorf("ByKind = %v", lines)
	}
	// On a cluster: the cluster's kinds, and the mode.
	res.Cluster, res.OutOfOrder, res.Ownership = true, 2, "partitions"
	res.Faults = []FaultRecord{{Kind: MasterKill}, {Kind: Reshard}, {Kind: Reshard}}
	got = res.Summary()
	if !strings.Contains(got, "faults=kill-relay:0,kill-consumer:0,failpoint:0,pg-terminate:0,pg-restart:0,busy-error:0,master-kill:1,master-stop:0,reshard:2,consumer-join:0,consumer-leave:0,stall:0,pg-flap:0,big-payloads:0,long-tx:0 ") ||
		!strings.HasSuffix(got, " out_of_order=2 mode=cluster ownership=partitions worst_after_fault_ms=0 worst_effect_after_fault_ms=0") {
		t.Errorf("cluster summary: %s", got)
	}
	if lines := res.ByKind(); len(lines) != len(ClusterKinds) {
		t.Errorf("cluster ByKind = %v", lines)
	}
}

// A run whose busy errors (or fail points, or Redis refusals) injected under
// load all failed to fire did not test them, and says so; one that fired passes, and so do
// faults injected after the load (nothing to fire on).
func TestRunWhoseBusyErrorsNeverFiredFails(t *testing.T) {
	missed := FaultRecord{Kind: BusyError, UnderLoad: true, Note: "did not fire within 30s (no traffic?)"}
	fired := FaultRecord{Kind: BusyError, UnderLoad: true, Note: "fired: a busy round trip failed; the relay stays up"}
	late := FaultRecord{Kind: Failpoint, Note: "did not fire within 30s (no traffic?); killed instead"}
	for _, c := range []struct {
		faults []FaultRecord
		want   int
	}{
		{[]FaultRecord{missed, missed}, 1},
		{[]FaultRecord{missed, fired}, 0},
		{[]FaultRecord{late, {Kind: KillRelay, UnderLoad: true}}, 0},
		{[]FaultRecord{missed, {Kind: Failpoint, UnderLoad: true, Note: late.Note}}, 2},
		{[]FaultRecord{{Kind: RedisOOM, UnderLoad: true, Note: "Redis refused no XADD: maxmemory 1"}}, 1},
		{[]FaultRecord{{Kind: RedisOOM, UnderLoad: true, Note: "fired: maxmemory 1"}}, 0},
		{[]FaultRecord{{Kind: RedisOOM, Note: "Redis refused no XADD: maxmemory 1"}}, 0},
	} {
		if got := (Result{Faults: c.faults}).unfired(); len(got) != c.want {
			t.Errorf("faults %+v: problems %q, want %d", c.faults, got, c.want)
		}
	}
}

// The offline velocity check counts exactly the verdicts that differ from
// settled order's.
func TestVerdictsDifferFromSettledOrder(t *testing.T) {
	base := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	third := int64(fraud.DefaultWindowLimitCents/2 - 1) // three of them pass the limit, two do not
	teds := map[string]ted{
		"a": {"ana", third, base},
		"b": {"ana", third, base.Add(10 * time.Minute)},
		"c": {"ana", third, base.Add(20 * time.Minute)},
		"d": {"ana", third, base.Add(90 * time.Minute)}, // the window of c and d holds two
		"e": {"bia", int64(fraud.DefaultAmountLimitCents + 1), base},
	}
	right := map[string]string{"a": "approve", "b": "approve", "c": "review", "d": "approve", "e": "review"}
	if n, ex := verdictsDiffer(teds, right); n != 0 {
		t.Fatalf("%d differ (e.g. %s), want 0", n, ex)
	}
	wrong := map[string]string{"a": "approve", "b": "approve", "c": "approve", "d": "review", "e": "review"}
	if n, _ := verdictsDiffer(teds, wrong); n != 2 {
		t.Fatalf("%d differ, want 2 (c and d)", n)
	}
}

// On NATS JetStream every run injects each of the mode's kinds (the
// server's kill and restart, a blackhole of it) and each fail point, and
// never a fault of Redis's the relays do not use.
func TestNATSModeFaultsCoverItsKinds(t *testing.T) {
	for _, short := range []bool{true, false} {
		r := &run{cfg: Config{Short: short, NATS: true}, rng: rand.New(rand.NewPCG(7, 7))}
		plan := r.mandatory()
		for range 200 {
			plan = append(plan, r.random())
		}
		kinds := map[string]bool{}
		for _, f := range plan {
			kinds[f.kind] = true
			if f.kind != RollingDeploy && !slices.Contains(NATSKinds, f.kind) {
				t.Errorf("short=%v: %s %s is not a NATS mode fault", short, f.kind, f.variant)
			}
			if f.kind == Blackhole && !slices.Contains(natsBlackholeTargets, f.variant) {
				t.Errorf("short=%v: blackhole of %q", short, f.variant)
			}
		}
		for _, k := range append(slices.Clone(NATSKinds), RollingDeploy) {
			if !kinds[k] {
				t.Errorf("short=%v: no %s in the plan", short, k)
			}
		}
		if !slices.Contains(plan[:len(r.mandatory())], planned{Blackhole, "nats"}) {
			t.Errorf("short=%v: the mandatory faults do not blackhole NATS", short)
		}
	}
}

// The load keeps its last TEDs for the faults that must fire (a fail point
// armed after the load ran out tested nothing): it trickles above the
// reserve's hold and, below it, settles only the bursts faults ask for.
func TestLoadKeepsItsLastTEDsForTheFaultsThatMustFire(t *testing.T) {
	r := &run{cfg: Config{Rate: 40}}
	steady := phase{count: 120, rate: 40}
	asked := phase{count: burstCount, rate: 400, burst: true, requested: true}
	askedThird := asked
	askedThird.count = burstCount / 3
	deploy := phase{count: deployBurstCount, rate: 400, burst: true, requested: true, lullAfter: deployLull}
	hold := burstCount * 3
	for _, c := range []struct {
		name            string
		ph              phase
		remaining, left int
		want            phase
		settles         bool
	}{
		{"well above the reserve", steady, 2*hold + 1, 3, steady, true},
		{"no fault left to fire", steady, 1, 0, steady, true},
		{"in the reserve: a trickle", steady, 2 * hold, 3, phase{count: 5, rate: 10}, true},
		{"the trickle stops at the hold", steady, hold + 2, 3, phase{count: 2, rate: 10}, true},
		{"at the hold: nothing unasked", steady, hold, 3, phase{}, false},
		{"above the reserve: a fault's burst whole", asked, 2*hold + 1, 3, asked, true},
		{"in the reserve: a third of a fault's burst", asked, 2 * hold, 3, askedThird, true},
		{"at the hold: a third of a fault's burst", asked, hold, 3, askedThird, true},
		{"at the hold: a deploy's burst whole", deploy, hold, 3, deploy, true},
	} {
		got, ok := r.reserve(c.ph, c.remaining, c.left)
		if ok != c.settles || got != c.want {
			t.Errorf("%s: reserve(%+v, %d left, %d faults) = %+v, %v; want %+v, %v",
				c.name, c.ph, c.remaining, c.left, got, ok, c.want, c.settles)
		}
	}
}
