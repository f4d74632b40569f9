package chart

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/tedbank/outbox/internal/bench"
)

// The SVGs in docs/charts are what their committed results draw: a chart
// edited by hand, or results measured again without 'make charts', fail.
func TestCommittedChartsMatchTheirResults(t *testing.T) {
	dir := filepath.Join("..", "..", "..", "docs", "charts")
	f, err := os.Open(filepath.Join(dir, "results.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	results, err := Read(f)
	if err != nil {
		t.Fatal(err)
	}
	charts := Charts(results)
	for _, name := range []string{"ratios.svg", "latency.svg", "failover.svg"} {
		want, ok := charts[name]
		if !ok {
			t.Errorf("docs/charts/results.jsonl draws no %s", name)
			continue
		}
		got, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("docs/charts/%s is not what docs/charts/results.jsonl draws (err %v): run make charts", name, err)
		}
	}
}

func ptr[T any](v T) *T { return &v }

// A figure that misses its target is drawn red, one that meets it blue,
// each with its target's tick and its runs' spread.
func TestRatiosShowTheTargets(t *testing.T) {
	results := []bench.Result{
		{Scenario: "drain", N: 50000, RatioToBaseline: ptr(0.55), Settings: map[string]any{"ownership": "rows"},
			Runs: []bench.Result{{RatioToBaseline: ptr(0.5)}, {RatioToBaseline: ptr(0.55)}, {RatioToBaseline: ptr(0.6)}}},
		{Scenario: "consume", N: 100000, RatioToBaseline: ptr(0.62), Settings: map[string]any{"effect": "lua"}},
		{Scenario: "latency_commit_to_stream", P50Ms: 0.9, P99Ms: 2, MaxMs: 5, RatioP50ToBaseline: ptr(1.3), RatioP99ToBaseline: ptr(1.1),
			Settings: map[string]any{"rate": 200}},
	}
	svg := string(Charts(results)["ratios.svg"])
	bars := regexp.MustCompile(`<text x="\d+" y="\d+" text-anchor="end">([^<]+)</text>\n<rect [^>]* fill="(#[0-9a-f]+)"/>`).FindAllStringSubmatch(svg, -1)
	got := map[string]string{}
	for _, b := range bars {
		got[b[1]] = b[2]
	}
	const red, blue = "#c0504d", "#4878a8"
	for label, want := range map[string]string{
		"drain 50k, ownership rows":    red,  // 0.55 < 0.9
		"consume 100k, effect lua":     blue, // 0.62 >= 0.5
		"commit → stream p50 at 200/s": red,  // 1.3 > 1.2
		"commit → stream p99 at 200/s": blue, // 1.1 <= 1.2
	} {
		if got[label] != want {
			t.Errorf("bar %q is %q, want %q\n%s", label, got[label], want, svg)
		}
	}
	if n := strings.Count(svg, `stroke="#e08a00"`); n != 4 {
		t.Errorf("%d target ticks, want 4", n)
	}
	if !strings.Contains(svg, `<line x1=`) || !strings.Contains(svg, "0.55×") {
		t.Errorf("no spread or value:\n%s", svg)
	}
	if lat := Charts(results)["latency.svg"]; !bytes.Contains(lat, []byte("stream, 200/s p99")) {
		t.Errorf("latency chart lacks the p99 bar:\n%s", lat)
	}
}
