// Package chart draws the figures of 'outbox bench --json' as SVG: the
// ratios against the minimal relay and consumer, the latency percentiles
// and the failover, for docs/benchmarks.md and docs/reliability.md. 'make
// charts' runs it over the committed results (docs/charts/results.jsonl);
// the same input always gives the same bytes.
package chart

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"html"
	"io"
	"math"
	"slices"
	"strings"

	"github.com/tedbank/outbox/internal/bench"
)

// Read reads one bench.Result per line (blank lines and lines starting
// with # are skipped).
func Read(r io.Reader) ([]bench.Result, error) {
	var out []bench.Result
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 1<<20), 16<<20)
	for line := 1; sc.Scan(); line++ {
		text := strings.TrimSpace(sc.Text())
		if text == "" || strings.HasPrefix(text, "#") {
			continue
		}
		var res bench.Result
		if err := json.Unmarshal([]byte(text), &res); err != nil {
			return nil, fmt.Errorf("line %d: not a bench result: %w", line, err)
		}
		out = append(out, res)
	}
	return out, sc.Err()
}

// A bar is one figure: its value, the spread of its runs (lo-hi, equal to
// value with one run), a target and on which side it must be.
type bar struct {
	label     string
	value     float64
	lo, hi    float64
	target    float64 // 0: none
	atMost    bool    // the target is a ceiling (latency), not a floor
	valueText string
}

// Charts returns the SVG files drawn from results, by file name: only
// those whose figures are in results.
func Charts(results []bench.Result) map[string][]byte {
	out := map[string][]byte{}
	if bars := ratioBars(results); len(bars) > 0 {
		out["ratios.svg"] = draw("Against the minimal relay and consumer (same run): ratio, runs' spread, target",
			bars, "ratio", false, 1)
	}
	if bars := latencyBars(results); len(bars) > 0 {
		out["latency.svg"] = draw("Commit → stream and → verdict, at the offered rate (ms, log scale)", bars, "ms", true, 0)
	}
	if bars := failoverBars(results); len(bars) > 0 {
		out["failover.svg"] = draw("A relay killed mid-batch: commit → stream of every TED (ms, log scale; dashed: 1 s)", bars, "ms", true, 1000)
	}
	return out
}

func setting(r bench.Result, key string) string {
	if v, ok := r.Settings[key]; ok {
		return fmt.Sprint(v)
	}
	return ""
}

// spread returns the lowest and highest of f over r's runs (f of r itself
// when it ran once).
func spread(r bench.Result, f func(bench.Result) (float64, bool)) (lo, hi float64) {
	v, _ := f(r)
	lo, hi = v, v
	for _, run := range r.Runs {
		if x, ok := f(run); ok {
			lo, hi = min(lo, x), max(hi, x)
		}
	}
	return lo, hi
}

func ratioBars(results []bench.Result) []bar {
	var bars []bar
	add := func(label string, r bench.Result, f func(bench.Result) (float64, bool), target float64, atMost bool) {
		v, ok := f(r)
		if !ok {
			return
		}
		lo, hi := spread(r, f)
		bars = append(bars, bar{label: label, value: v, lo: lo, hi: hi, target: target, atMost: atMost, valueText: fmt.Sprintf("%.2f×", v)})
	}
	deref := func(p *float64) (float64, bool) {
		if p == nil {
			return 0, false
		}
		return *p, true
	}
	for _, r := range results {
		ratio := func(x bench.Result) (float64, bool) { return deref(x.RatioToBaseline) }
		switch r.Scenario {
		case "drain":
			add(fmt.Sprintf("drain %s, ownership %s", count(r.N), cmpOr(setting(r, "ownership"), "auto")), r, ratio, 0.9, false)
		case "consume":
			add(fmt.Sprintf("consume %s, effect %s", count(r.N), cmpOr(setting(r, "effect"), "lua")), r, ratio, 0.5, false)
		case "latency_commit_to_stream":
			rate := setting(r, "rate")
			add("commit → stream p50 at "+rate+"/s", r, func(x bench.Result) (float64, bool) { return deref(x.RatioP50ToBaseline) }, 1.2, true)
			add("commit → stream p99 at "+rate+"/s", r, func(x bench.Result) (float64, bool) { return deref(x.RatioP99ToBaseline) }, 1.2, true)
		case "writers":
			if setting(r, "mode") == "idle" {
				add("writers "+setting(r, "writers")+", notify idle / off", r, func(x bench.Result) (float64, bool) { return deref(x.RatioToOff) }, 0.9, false)
			}
		}
	}
	return bars
}

// count is n as 50k, 200k, 1M.
func count(n int) string {
	switch {
	case n >= 1_000_000 && n%1_000_000 == 0:
		return fmt.Sprintf("%dM", n/1_000_000)
	case n >= 1000 && n%1000 == 0:
		return fmt.Sprintf("%dk", n/1000)
	}
	return fmt.Sprint(n)
}

func cmpOr(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

func percentileBars(r bench.Result, name string) []bar {
	var bars []bar
	for _, p := range []struct {
		label string
		f     func(bench.Result) float64
	}{
		{"p50", func(x bench.Result) float64 { return x.P50Ms }},
		{"p99", func(x bench.Result) float64 { return x.P99Ms }},
		{"max", func(x bench.Result) float64 { return x.MaxMs }},
	} {
		v := p.f(r)
		if v <= 0 {
			continue
		}
		lo, hi := spread(r, func(x bench.Result) (float64, bool) { return p.f(x), p.f(x) > 0 })
		bars = append(bars, bar{label: name + " " + p.label, value: v, lo: lo, hi: hi, valueText: fmt.Sprintf("%.2f ms", v)})
	}
	return bars
}

func latencyBars(results []bench.Result) []bar {
	var bars []bar
	for _, r := range results {
		rate := setting(r, "rate")
		switch r.Scenario {
		case "latency_commit_to_stream":
			bars = append(bars, percentileBars(r, "stream, "+rate+"/s")...)
		case "latency_minimal_commit_to_stream":
			bars = append(bars, percentileBars(r, "stream, minimal relay, "+rate+"/s")...)
		case "latency_commit_to_verdict":
			bars = append(bars, percentileBars(r, "verdict, "+rate+"/s")...)
		}
	}
	return bars
}

func failoverBars(results []bench.Result) []bar {
	var bars []bar
	for _, r := range results {
		if strings.HasPrefix(r.Scenario, "failover") {
			bars = append(bars, percentileBars(r, "ownership "+cmpOr(setting(r, "ownership"), "?"))...)
		}
	}
	return bars
}

// draw renders horizontal bars, one per row, with each bar's spread as a
// whisker and its target as a tick; on a log scale when log is set, with a
// reference line at ref when it is not 0.
func draw(title string, bars []bar, unit string, log bool, ref float64) []byte {
	const (
		width, left, right, top, rowH = 900, 300, 90, 48, 26
	)
	height := top + rowH*len(bars) + 40
	hi := ref
	lo := math.Inf(1)
	for _, b := range bars {
		hi = max(hi, b.hi, b.value, b.target)
		if b.lo > 0 {
			lo = min(lo, b.lo)
		}
	}
	plotW := float64(width - left - right)
	x := func(v float64) float64 { return float64(left) + plotW*v/(hi*1.1) }
	var ticks []float64
	if log {
		lo = math.Pow(10, math.Floor(math.Log10(lo)))
		top10 := math.Pow(10, math.Ceil(math.Log10(hi)))
		x = func(v float64) float64 {
			v = max(v, lo)
			return float64(left) + plotW*math.Log10(v/lo)/math.Log10(top10/lo)
		}
		for t := lo; t <= top10*1.0001; t *= 10 {
			ticks = append(ticks, t)
		}
	} else {
		for t := 0.0; t <= hi*1.1; t += 0.25 {
			ticks = append(ticks, t)
		}
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n",
		width, height, width, height)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="#ffffff"/>`+"\n")
	fmt.Fprintf(&b, `<text x="%d" y="24" font-size="14" font-weight="bold">%s</text>`+"\n", 10, html.EscapeString(title))
	for _, t := range ticks {
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#e5e5e5"/>`+"\n", x(t), top-6, x(t), height-34)
		fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle" fill="#666">%s</text>`+"\n", x(t), height-20, tickLabel(t, unit))
	}
	if ref > 0 {
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#333" stroke-dasharray="4 3"/>`+"\n", x(ref), top-10, x(ref), height-34)
	}
	for i, br := range bars {
		y := top + i*rowH
		color := "#4878a8"
		if br.target > 0 && (br.atMost && br.value > br.target || !br.atMost && br.value < br.target) {
			color = "#c0504d" // misses its target
		}
		fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="end">%s</text>`+"\n", left-8, y+15, html.EscapeString(br.label))
		x0 := float64(left)
		fmt.Fprintf(&b, `<rect x="%.1f" y="%d" width="%.1f" height="16" fill="%s"/>`+"\n", x0, y+3, max(x(br.value)-x0, 1), color)
		if br.hi > br.lo {
			fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#222"/>`+"\n", x(br.lo), y+11, x(br.hi), y+11)
		}
		if br.target > 0 {
			fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#e08a00" stroke-width="3"/>`+"\n", x(br.target), y, x(br.target), y+22)
		}
		labelX := max(x(br.value), x(br.hi)) + 6
		if br.target > 0 && x(br.target) >= labelX-4 && x(br.target) <= labelX+56 {
			labelX = x(br.target) + 6 // not through the target's tick
		}
		fmt.Fprintf(&b, `<text x="%.1f" y="%d">%s</text>`+"\n", labelX, y+15, html.EscapeString(br.valueText))
	}
	if slices.ContainsFunc(bars, func(b bar) bool { return b.target > 0 }) {
		fmt.Fprintf(&b, `<text x="%d" y="%d" fill="#666">orange tick: the target; red bar: misses it; black line: the runs' spread</text>`+"\n", left, height-4)
	}
	b.WriteString("</svg>\n")
	return b.Bytes()
}

func tickLabel(t float64, unit string) string {
	switch {
	case unit == "ratio":
		return fmt.Sprintf("%.2g", t)
	case t >= 1:
		return fmt.Sprintf("%g", t)
	default:
		return fmt.Sprintf("%.2g", t)
	}
}
