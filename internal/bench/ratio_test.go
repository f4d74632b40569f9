package bench

import (
	"strings"
	"testing"
)

// The latency ratios compare two runs only when both runs' writers reached
// the offered rate; otherwise the result says which fell short.
func TestLatencyRatiosOnlyWhenBothRunsReachTheRate(t *testing.T) {
	for _, tc := range []struct {
		name          string
		mine, minimal float64 // events_per_s of each run, 1,000/s offered
		withheld      []string
	}{
		{"both reached", 990, 950, nil},
		{"exactly 90 %", 900, 900, nil},
		{"the minimal relay's short", 995, 742, []string{"the minimal relay's writers reached 742 of the 1000"}},
		{"this project's short", 700, 990, []string{"this project's writers reached 700 of the 1000"}},
		{"both short", 700, 742, []string{"this project's writers reached 700", "the minimal relay's writers reached 742"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := Result{EventsPerS: tc.mine, P50Ms: 3, P99Ms: 12}
			base := Result{EventsPerS: tc.minimal, P50Ms: 2, P99Ms: 4}
			latencyRatios(&r, base, 1000)
			if tc.withheld == nil {
				if r.RatioWithheld != nil || r.RatioP50ToBaseline == nil || *r.RatioP50ToBaseline != 1.5 ||
					r.RatioP99ToBaseline == nil || *r.RatioP99ToBaseline != 3 {
					t.Fatalf("ratios %v %v withheld %v, want 1.5 and 3", r.RatioP50ToBaseline, r.RatioP99ToBaseline, r.RatioWithheld)
				}
				return
			}
			if r.RatioP50ToBaseline != nil || r.RatioP99ToBaseline != nil || r.RatioWithheld == nil {
				t.Fatalf("ratios %v %v withheld %v, want none and the reason", r.RatioP50ToBaseline, r.RatioP99ToBaseline, r.RatioWithheld)
			}
			for _, want := range tc.withheld {
				if !strings.Contains(*r.RatioWithheld, want) {
					t.Errorf("withheld %q, want it to say %q", *r.RatioWithheld, want)
				}
			}
		})
	}
}

// With --runs, a ratio's median is over the runs that have one: a run whose
// ratio was withheld counts neither as 0 nor at all, and the combined result
// says in how many runs it was withheld.
func TestCombinedRatiosSkipWithheldRuns(t *testing.T) {
	withheld := "the minimal relay's writers reached 742 of the 1000 TEDs/s offered"
	runs := []Result{
		{RatioP50ToBaseline: ptr(1.2), RatioP99ToBaseline: ptr(2.0)},
		{RatioWithheld: &withheld},
		{RatioP50ToBaseline: ptr(1.0), RatioP99ToBaseline: ptr(4.0)},
		{RatioP50ToBaseline: ptr(1.1), RatioP99ToBaseline: ptr(3.0)},
	}
	c := combine(runs)
	if c.RatioP50ToBaseline == nil || *c.RatioP50ToBaseline != 1.1 || c.RatioP99ToBaseline == nil || *c.RatioP99ToBaseline != 3.0 {
		t.Errorf("medians %v %v, want 1.1 and 3 (over the three runs with ratios)", c.RatioP50ToBaseline, c.RatioP99ToBaseline)
	}
	if c.RatioWithheld == nil || !strings.Contains(*c.RatioWithheld, "1 of 4 runs") {
		t.Errorf("withheld %v, want it to say 1 of 4 runs", c.RatioWithheld)
	}
	none := combine([]Result{{RatioWithheld: &withheld}, {RatioWithheld: &withheld}})
	if none.RatioP50ToBaseline != nil || none.RatioWithheld == nil || !strings.Contains(*none.RatioWithheld, "2 of 2 runs") {
		t.Errorf("all withheld: ratio %v withheld %v", none.RatioP50ToBaseline, none.RatioWithheld)
	}
	if ok := combine([]Result{runs[0], runs[2]}); ok.RatioWithheld != nil {
		t.Errorf("no run withheld, yet %q", *ok.RatioWithheld)
	}
}
