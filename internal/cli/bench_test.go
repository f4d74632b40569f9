package cli

import (
	"encoding/json"
	"math"
	"strings"
	"testing"

	"github.com/tedbank/outbox/internal/bench"
	"github.com/tedbank/outbox/internal/outboxtest"
)

// benchLines runs one bench command line and decodes its JSON lines, checking
// the contract's fields on each.
func benchLines(t *testing.T, vars map[string]string, args ...string) []bench.Result {
	t.Helper()
	code, stdout, stderr := run(t, vars, args...)
	if code != exitOK {
		t.Fatalf("%v: exit %d: %s", args, code, stderr)
	}
	var out []bench.Result
	for _, line := range strings.Split(strings.TrimSpace(stdout), "\n") {
		var r bench.Result
		var raw map[string]any
		if err := json.Unmarshal([]byte(line), &r); err != nil || json.Unmarshal([]byte(line), &raw) != nil {
			t.Fatalf("%v: not JSON: %s", args, line)
		}
		for _, k := range []string{"scenario", "n", "seconds", "events_per_s", "p50_ms", "p90_ms", "p99_ms", "max_ms", "settings"} {
			if _, ok := raw[k]; !ok {
				t.Errorf("%v: result lacks %q: %s", args, k, line)
			}
		}
		if r.EventsPerS <= 0 || r.N <= 0 || r.Seconds <= 0 || r.Settings == nil {
			t.Errorf("%v: result %s", args, line)
		}
		if r.P50Ms > r.P90Ms || r.P90Ms > r.P99Ms || r.P99Ms > r.MaxMs {
			t.Errorf("%v: percentiles out of order: %s", args, line)
		}
		out = append(out, r)
	}
	return out
}

func scenarios(rs []bench.Result) string {
	var s []string
	for _, r := range rs {
		s = append(s, r.Scenario)
	}
	return strings.Join(s, ",")
}

// The harness runs each scenario in a database of its own and prints one
// JSON line per result with the contract's fields. Tiny sizes: this checks
// the harness, not the figures.
func TestBenchJSON(t *testing.T) {
	vars := map[string]string{"DATABASE_URL": outboxtest.PostgresURL(t), "REDIS_URL": outboxtest.NewRedis(t).URL}

	t.Run("drain", func(t *testing.T) {
		rs := benchLines(t, vars, "bench", "drain", "--n", "300", "--relays", "2", "--json")
		if scenarios(rs) != "drain" || rs[0].N != 300 || rs[0].Settings["relays"] != float64(2) {
			t.Fatalf("%+v", rs)
		}
		if rs[0].PeakRSSKB == nil || *rs[0].PeakRSSKB <= 0 {
			t.Errorf("no peak_rss_kb: %+v", rs[0])
		}
		if b := rs[0].BaselineEventsPerS; b == nil || *b <= 0 || rs[0].RatioToBaseline == nil ||
			math.Abs(*rs[0].RatioToBaseline - rs[0].EventsPerS / *b) > 1e-9 {
			t.Errorf("no minimal relay's figures: %+v", rs[0])
		}
	})
	t.Run("latency", func(t *testing.T) {
		rs := benchLines(t, vars, "bench", "latency", "--rate", "200", "--n", "40", "--json")
		if scenarios(rs) != "latency_commit_to_stream,latency_commit_to_verdict,latency_minimal_commit_to_stream" {
			t.Fatalf("%+v", rs)
		}
		// The ratios when both runs' writers reached 90 % of the rate (a
		// loaded machine may not, in 40 TEDs), the reason otherwise.
		if r := rs[0]; r.EventsPerS >= 180 && rs[2].EventsPerS >= 180 {
			if r.RatioWithheld != nil || r.RatioP50ToBaseline == nil || math.Abs(*r.RatioP50ToBaseline-r.P50Ms/rs[2].P50Ms) > 1e-9 ||
				r.RatioP99ToBaseline == nil || math.Abs(*r.RatioP99ToBaseline-r.P99Ms/rs[2].P99Ms) > 1e-9 {
				t.Errorf("the ratios to the minimal relay: %+v", r)
			}
		} else if r.RatioWithheld == nil || r.RatioP50ToBaseline != nil || r.RatioP99ToBaseline != nil {
			t.Errorf("a run's writers fell short of the rate (%.0f and %.0f of 200/s), yet the ratios: %+v", r.EventsPerS, rs[2].EventsPerS, r)
		}
		for i, r := range rs {
			// n counts the timed TEDs only, after the warm-up's.
			if r.N != 40 || r.MaxMs <= 0 || (i < 2 && r.PollsWithWork == nil) || r.MaxScheduleLagMs == nil || r.Errors == nil || *r.Errors != 0 ||
				r.Settings["warm_up"] != "2s" || r.WarmUpOverOneS == nil {
				t.Errorf("%+v", r)
			}
			checkOverOneS(t, r)
		}
	})
	t.Run("consume", func(t *testing.T) {
		rs := benchLines(t, vars, "bench", "consume", "--n", "200", "--consumers", "2", "--duplicates", "0.1", "--runs", "2", "--json")
		if scenarios(rs) != "consume" {
			t.Fatalf("%+v", rs)
		}
		r := rs[0]
		if r.N != 200 || r.Duplicates == nil || *r.Duplicates != 20 || len(r.Runs) != 2 || r.Settings["runs"] != float64(2) {
			t.Fatalf("%+v", r)
		}
		for _, run := range r.Runs {
			if run.N != 200 || run.EventsPerS <= 0 || run.BaselineEventsPerS == nil || *run.BaselineEventsPerS <= 0 ||
				run.RatioToBaseline == nil || math.Abs(*run.RatioToBaseline - run.EventsPerS / *run.BaselineEventsPerS) > 1e-9 {
				t.Errorf("run %+v", run)
			}
		}
		if r.RatioToBaseline == nil {
			t.Errorf("no ratio_to_baseline in the medians: %+v", r)
		}
	})
	t.Run("sustained", func(t *testing.T) {
		rs := benchLines(t, vars, "bench", "sustained", "--rate", "100", "--duration", "500ms", "--json")
		if scenarios(rs) != "sustained" {
			t.Fatalf("%+v", rs)
		}
		r := rs[0]
		if r.N != 50 || r.MaxBacklog == nil || r.BacklogBounded == nil || r.MaxMs <= 0 {
			t.Fatalf("%+v", r)
		}
		checkOverOneS(t, r)
	})
	t.Run("writers", func(t *testing.T) {
		rs := benchLines(t, vars, "bench", "writers", "--writers", "1,2", "--modes", "off,idle",
			"--duration", "300ms", "--poll", "100ms", "--json")
		if scenarios(rs) != "writers,writers,writers,writers" {
			t.Fatalf("%+v", rs)
		}
		want := []struct {
			writers float64
			mode    string
		}{{1, "off"}, {1, "idle"}, {2, "off"}, {2, "idle"}}
		for i, r := range rs {
			if r.Settings["writers"] != want[i].writers || r.Settings["mode"] != want[i].mode || r.MaxMs <= 0 ||
				r.RatioToOff == nil || r.BacklogAtEnd == nil || r.Errors == nil || *r.Errors != 0 {
				t.Errorf("case %d: %+v", i, r)
			}
			if want[i].mode == "off" && *r.RatioToOff != 1 {
				t.Errorf("case %d: ratio_to_off %v, want 1", i, *r.RatioToOff)
			}
		}
	})
	t.Run("table", func(t *testing.T) {
		code, stdout, stderr := run(t, vars, "bench", "consume", "--n", "50")
		if code != exitOK || !strings.HasPrefix(stdout, "scenario") || !strings.Contains(stdout, "duplicates=") {
			t.Fatalf("exit %d: %s%s", code, stdout, stderr)
		}
	})

	for _, args := range [][]string{
		{"bench", "nope"},
		{"bench"},
		{"bench", "writers", "--writers", "0"},
		{"bench", "writers", "--modes", "off,sometimes"},
		{"bench", "consume", "--duplicates", "1"},
		{"bench", "sustained", "--duration", "0s"},
		{"bench", "drain", "--runs", "0"},
	} {
		if code, stdout, _ := run(t, vars, args...); code != exitUsage || stdout != "" {
			t.Errorf("%v: exit %d, want 2", args, code)
		}
	}
}

// checkOverOneS: over_1s is reported and agrees with max_ms.
func checkOverOneS(t *testing.T, r bench.Result) {
	t.Helper()
	switch {
	case r.OverOneS == nil:
		t.Errorf("%s: no over_1s", r.Scenario)
	case (*r.OverOneS > 0) != (r.MaxMs > 1000):
		t.Errorf("%s: over_1s=%d with max_ms=%.1f", r.Scenario, *r.OverOneS, r.MaxMs)
	}
}
