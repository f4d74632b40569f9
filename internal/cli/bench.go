package cli

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/tedbank/outbox/internal/bench"
	"github.com/tedbank/outbox/internal/connect"
)

func runBench(ctx context.Context, e *env, args []string) error {
	if len(args) == 0 || (args[0] != "drain" && args[0] != "latency") {
		return usagef("want a scenario: 'outbox bench drain' or 'outbox bench latency'")
	}
	scenario := args[0]
	var c common
	fs := e.flags("bench "+scenario, &c)
	asJSON := fs.Bool("json", false, "print one JSON line per result")
	var n, relays, batch *int
	var rate *float64
	if scenario == "drain" {
		n = fs.Int("n", 20_000, "backlog size")
		relays = fs.Int("relays", 1, "relays draining it")
		batch = fs.Int("batch", 500, "relay batch size")
	} else {
		n = fs.Int("n", 2_000, "TEDs to settle")
		rate = fs.Float64("rate", 200, "TEDs per second")
	}
	if err := e.parse(fs, args[1:]); err != nil {
		return err
	}
	switch {
	case *n <= 0:
		return usagef("--n must be positive")
	case relays != nil && (*relays <= 0 || *relays > 64):
		return usagef("--relays must be between 1 and 64")
	case batch != nil && (*batch <= 0 || *batch > 10_000):
		return usagef("--batch must be between 1 and 10000")
	case rate != nil && *rate <= 0:
		return usagef("--rate must be positive")
	}
	log, err := c.logger(e.stderr)
	if err != nil {
		return err
	}
	// Check the servers first, for the usual one-line error.
	pool, err := connect.Postgres(ctx, c.databaseURL, connect.PostgresOptions{AppName: "outbox-bench", MaxConns: 1})
	if err != nil {
		return err
	}
	pool.Close()
	rdb, err := connect.Redis(ctx, c.redisURL, connect.RedisOptions{ClientName: "outbox-bench", NoRetries: true, PoolSize: 64})
	if err != nil {
		return err
	}
	defer rdb.Close()
	env := bench.Env{AdminURL: c.databaseURL, Redis: rdb, Log: log}

	var results []bench.Result
	if scenario == "drain" {
		r, err := bench.Drain(ctx, env, *n, *relays, *batch)
		if err != nil {
			return err
		}
		results = []bench.Result{r}
	} else {
		if results, err = bench.Latency(ctx, env, *rate, *n); err != nil {
			return err
		}
	}
	for _, r := range results {
		if *asJSON {
			if err := json.NewEncoder(e.stdout).Encode(r); err != nil {
				return err
			}
			continue
		}
		fmt.Fprintf(e.stdout, "%-26s n=%-7d %9.0f events/s  p50 %7.2f ms  p90 %7.2f ms  p99 %7.2f ms  max %7.2f ms  %v\n",
			r.Scenario, r.N, r.EventsPerS, r.P50Ms, r.P90Ms, r.P99Ms, r.MaxMs, r.Settings)
	}
	return nil
}
