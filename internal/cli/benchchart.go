package cli

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/tedbank/outbox/internal/bench"
	"github.com/tedbank/outbox/internal/bench/chart"
)

// runBenchChart draws the results of 'outbox bench ... --json' as SVG
// (internal/bench/chart): 'make charts' runs it over docs/charts/results.jsonl.
func runBenchChart(e *env, args []string) error {
	e.cmd = "bench chart"
	fs := e.flags("bench chart", nil)
	usageLine(fs, "outbox bench chart --in results.jsonl [--in more.jsonl] [--out DIR]")
	var in []string
	fs.Func("in", "a file of 'outbox bench --json' lines (repeat for several)", func(s string) error {
		in = append(in, s)
		return nil
	})
	out := fs.String("out", ".", "the directory to write ratios.svg, latency.svg and failover.svg to (those the results have figures for)")
	if err := e.parse(fs, args); err != nil {
		return err
	}
	if len(in) == 0 {
		return usagef("give the results to draw: --in results.jsonl (lines of 'outbox bench ... --json')")
	}
	var all []bench.Result
	for _, name := range in {
		f, err := os.Open(name)
		if err != nil {
			return err
		}
		rs, err := chart.Read(f)
		_ = f.Close()
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		all = append(all, rs...)
	}
	files := chart.Charts(all)
	if len(files) == 0 {
		return fmt.Errorf("nothing to draw: the results have no drain, consume, latency, writers or failover figures")
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		return err
	}
	var names []string
	for name, svg := range files {
		if err := os.WriteFile(filepath.Join(*out, name), svg, 0o644); err != nil {
			return err
		}
		names = append(names, name)
	}
	slices.Sort(names)
	fmt.Fprintf(e.stdout, "wrote %s to %s\n", strings.Join(names, ", "), *out)
	return nil
}
