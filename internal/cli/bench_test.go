package cli

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/tedbank/outbox/internal/bench"
	"github.com/tedbank/outbox/internal/outboxtest"
)

// The harness runs each scenario in a database of its own and prints one
// JSON line per result with the contract's fields.
func TestBenchJSON(t *testing.T) {
	vars := map[string]string{"DATABASE_URL": outboxtest.PostgresURL(t), "REDIS_URL": outboxtest.NewRedis(t).URL}
	for _, c := range []struct {
		args      []string
		scenarios []string
	}{
		{[]string{"bench", "drain", "--n", "300", "--relays", "2", "--json"}, []string{"drain"}},
		{[]string{"bench", "latency", "--rate", "200", "--n", "40", "--json"}, []string{"latency_commit_to_stream", "latency_commit_to_verdict"}},
	} {
		code, stdout, stderr := run(t, vars, c.args...)
		if code != exitOK {
			t.Fatalf("%v: exit %d: %s", c.args, code, stderr)
		}
		lines := strings.Split(strings.TrimSpace(stdout), "\n")
		if len(lines) != len(c.scenarios) {
			t.Fatalf("%v: %d lines, want %d:\n%s", c.args, len(lines), len(c.scenarios), stdout)
		}
		for i, line := range lines {
			var r bench.Result
			var raw map[string]any
			if err := json.Unmarshal([]byte(line), &r); err != nil || json.Unmarshal([]byte(line), &raw) != nil {
				t.Fatalf("%v: not JSON: %s", c.args, line)
			}
			for _, k := range []string{"scenario", "n", "events_per_s", "p50_ms", "p90_ms", "p99_ms", "max_ms", "settings"} {
				if _, ok := raw[k]; !ok {
					t.Errorf("%v: result lacks %q: %s", c.args, k, line)
				}
			}
			if r.Scenario != c.scenarios[i] || r.EventsPerS <= 0 || r.N <= 0 {
				t.Errorf("%v: result %+v", c.args, r)
			}
		}
	}
	if code, _, _ := run(t, vars, "bench", "nope"); code != exitUsage {
		t.Fatalf("unknown scenario: exit %d, want 2", code)
	}
}
