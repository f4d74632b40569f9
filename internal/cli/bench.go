package cli

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/tedbank/outbox/internal/bench"
	"github.com/tedbank/outbox/internal/connect"
	"github.com/tedbank/outbox/relay"
)

// benchScenarios are the scenarios of 'outbox bench', in the order of -h.
var benchScenarios = []string{"writers", "latency", "drain", "consume", "sustained", "failover"}

func runBench(ctx context.Context, e *env, args []string) error {
	e.cmd = "bench"
	if len(args) > 0 && slices.Contains([]string{"-h", "-help", "--help", "help"}, args[0]) {
		fmt.Fprintf(e.stderr, "usage: outbox bench <%s> [flags]\n\n", strings.Join(benchScenarios, "|"))
		fmt.Fprintln(e.stderr, "Measures the outbox on the servers of --database-url / --redis-url, each case in a fresh")
		fmt.Fprintln(e.stderr, "database (docs/benchmarks.md says what each scenario measures).")
		fmt.Fprintln(e.stderr, "\nRun 'outbox bench <scenario> -h' for its flags; 'outbox bench chart' draws --json results as SVG.")
		return flag.ErrHelp
	}
	if len(args) > 0 && args[0] == "chart" {
		return runBenchChart(e, args[1:])
	}
	if len(args) == 0 || !slices.Contains(benchScenarios, args[0]) {
		return usagef("want a scenario: 'outbox bench %s', or 'outbox bench chart' to draw results", strings.Join(benchScenarios, "|"))
	}
	scenario := args[0]
	var c common
	fs := e.flags("bench "+scenario, &c)
	asJSON := fs.Bool("json", false, "print one JSON line per result")
	runs := fs.Int("runs", 1, "run each case this many times and report the medians (every run's figures under runs)")
	var (
		n, relays, batch, consumers  *int
		published                    *int
		holdHorizon                  = new(bool)
		behind                       = new(int)
		rate, dup                    *float64
		duration, poll, offPoll      *time.Duration
		writersList, modesList, mode *string
		effect                       *string
		baseline                     *bool
		broker                       *brokerChoice
		minReplicas                  *int
		writerCounts                 []int
		modes                        []string
		maxWriters, maxConsumers     = 256, 64
		maxRelays, maxBatch, maxRuns = 64, 10_000, 100
	)
	switch scenario {
	case "writers":
		writersList = fs.String("writers", "1,8,32", "comma-separated concurrent writer counts, one case each")
		modesList = fs.String("modes", "off,always,idle", "comma-separated notify modes (outbox_notify_mode), one case each")
		duration = fs.Duration("duration", 10*time.Second, "how long the writers commit in each case")
		poll = fs.Duration("poll", 5*time.Second, "the relay's fallback poll interval")
		offPoll = fs.Duration("off-poll", 20*time.Millisecond, "the relay's poll in mode off, so that it drains while the writers run as it does when woken (0 = --poll)")
	case "latency":
		n = fs.Int("n", 2_000, "TEDs to settle")
		rate = fs.Float64("rate", 200, "TEDs per second (open-loop schedule)")
		mode = fs.String("mode", "", "notify mode to switch to first: off, always or idle (default: the migrations')")
		minReplicas = fs.Int("min-replicas", 0, "relay and consumer wait for this many Redis replicas (--min-replicas); the Redis needs them")
		baseline = fs.Bool("baseline", true, "also run the minimal relay (Redis Streams only) on the same schedule, for ratio_p50_to_baseline and ratio_p99_to_baseline")
		holdHorizon = fs.Bool("hold-horizon", false, "keep a transaction with an xid open from before --behind's backlog to the end of the run (a long report or an idle-in-transaction session)")
		behind = fs.Int("behind", 100_000, "with --hold-horizon: a backlog of this many events, of an aggregate type of their own, that the relay publishes while the horizon is held, before the warm-up (the row versions its marks leave stay)")
	case "drain":
		n = fs.Int("n", 20_000, "backlog size")
		relays = fs.Int("relays", 1, "relays draining it")
		batch = fs.Int("batch", 500, "relay batch size")
		published = fs.Int("published", 0, "already published rows in the table before the backlog (an outbox that has run for a while)")
		baseline = fs.Bool("baseline", true, "also run the minimal relay (Redis Streams only) over the same table, for ratio_to_baseline")
		holdHorizon = fs.Bool("hold-horizon", false, "keep a transaction with an xid open through the drain (a long report or an idle-in-transaction session): the row versions the marks leave stay")
	case "consume":
		n = fs.Int("n", 20_000, "stream entries to preload, duplicates included")
		consumers = fs.Int("consumers", 1, "anti-fraud consumers of the group")
		batch = fs.Int("batch", 100, "entries per consumer read")
		dup = fs.Float64("duplicates", 0.05, "fraction of the entries that re-add an earlier entry's event")
		baseline = fs.Bool("baseline", true, "also run the minimal consumer (Redis Streams only) over as many entries, for ratio_to_baseline")
		effect = fs.String("effect", bench.EffectLua, "the consumers' effect: lua (anti-fraud's scripts in Redis) or inbox (the ledger's double entries in PostgreSQL with the inbox)")
	case "sustained":
		rate = fs.Float64("rate", 500, "TEDs per second (open-loop schedule)")
		duration = fs.Duration("duration", 30*time.Second, "how long to settle at --rate")
		mode = fs.String("mode", "", "notify mode to switch to first: off, always or idle (default: the migrations')")
	case "failover":
		rate = fs.Float64("rate", 100, "TEDs per second (open-loop schedule)")
		duration = fs.Duration("duration", 20*time.Second, "how long to settle at --rate; the victim relay is killed a third of the way in")
	}
	var ownership *string
	var busyRows *int
	if scenario != "consume" {
		ownership = fs.String("ownership", envOr(e.getenv, "OUTBOX_RELAY_OWNERSHIP", relay.OwnAuto), "the relays' --ownership: auto, rows or partitions (env OUTBOX_RELAY_OWNERSHIP)")
		busyRows = fs.Int("busy-rows", relay.DefaultBusyRows, "the relays' --busy-rows")
	}
	var partitions func() (int, error)
	if scenario != "writers" {
		partitions = partitionsFlag(e, fs, "the relays' and consumers' partitions")
		broker = brokerFlags(e, fs)
	}
	if err := e.parse(fs, args[1:]); err != nil {
		return err
	}
	switch {
	case *runs < 1 || *runs > maxRuns:
		return usagef("--runs must be between 1 and %d", maxRuns)
	case n != nil && *n <= 0:
		return usagef("--n must be positive")
	case published != nil && *published < 0:
		return usagef("--published must not be negative")
	case *behind < 0:
		return usagef("--behind must not be negative")
	case relays != nil && (*relays <= 0 || *relays > maxRelays):
		return usagef("--relays must be between 1 and %d", maxRelays)
	case batch != nil && (*batch <= 0 || *batch > maxBatch):
		return usagef("--batch must be between 1 and %d", maxBatch)
	case consumers != nil && (*consumers <= 0 || *consumers > maxConsumers):
		return usagef("--consumers must be between 1 and %d", maxConsumers)
	case rate != nil && *rate <= 0:
		return usagef("--rate must be positive")
	case dup != nil && (*dup < 0 || *dup >= 1):
		return usagef("--duplicates must be at least 0 and below 1")
	case duration != nil && *duration < 100*time.Millisecond:
		return usagef("--duration must be at least 100ms")
	case offPoll != nil && *offPoll < 0:
		return usagef("--off-poll must not be negative")
	case poll != nil && *poll < time.Millisecond:
		return usagef("--poll must be at least 1ms")
	case minReplicas != nil && *minReplicas < 0:
		return usagef("--min-replicas must not be negative")
	case busyRows != nil && *busyRows < 1:
		return usagef("--busy-rows %d: must be at least 1", *busyRows)
	case ownership != nil && *ownership != relay.OwnAuto && *ownership != relay.OwnRows && *ownership != relay.OwnPartitions:
		return usagef("--ownership %q: want %s, %s or %s", *ownership, relay.OwnAuto, relay.OwnRows, relay.OwnPartitions)
	case effect != nil && *effect != bench.EffectLua && *effect != bench.EffectInbox:
		return usagef("--effect %q: want %s or %s", *effect, bench.EffectLua, bench.EffectInbox)
	}
	if broker != nil {
		if err := broker.check(); err != nil {
			return err
		}
		if broker.nats() && minReplicas != nil && *minReplicas > 0 {
			return usagef("--min-replicas is about Redis: not with --broker nats")
		}
	}
	nParts := 1
	if partitions != nil {
		var err error
		if nParts, err = partitions(); err != nil {
			return err
		}
	}
	if mode != nil && *mode != "" && *mode != "off" && *mode != "always" && *mode != "idle" {
		return usagef("--mode %q: want off, always or idle", *mode)
	}
	if writersList != nil {
		for _, f := range strings.Split(*writersList, ",") {
			w, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || w < 1 || w > maxWriters {
				return usagef("--writers %q: want comma-separated counts between 1 and %d", *writersList, maxWriters)
			}
			writerCounts = append(writerCounts, w)
		}
		for _, f := range strings.Split(*modesList, ",") {
			m := strings.TrimSpace(f)
			if m != "off" && m != "always" && m != "idle" {
				return usagef("--modes %q: want comma-separated modes among off, always and idle", *modesList)
			}
			modes = append(modes, m)
		}
	}
	// The relays and consumers under measurement log their warnings and
	// errors only, unless a level is asked for: an info line per reviewed TED
	// would be measured too.
	levelSet := e.getenv("OUTBOX_LOG_LEVEL") != ""
	fs.Visit(func(f *flag.Flag) { levelSet = levelSet || f.Name == "log-level" })
	if !levelSet {
		c.logLevel = "warn"
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
	rdb, err := c.redis(ctx, connect.RedisOptions{ClientName: "outbox-bench", NoRetries: true, PoolSize: 128})
	if err != nil {
		return err
	}
	defer rdb.Close()
	env := bench.Env{AdminURL: c.databaseURL, Redis: rdb, Log: log}
	if broker != nil && broker.nats() {
		nc, js, err := broker.connect("outbox-bench")
		if err != nil {
			return err
		}
		defer nc.Close()
		env.JS = js
	}
	if minReplicas != nil {
		env.MinReplicas = *minReplicas
	}
	env.Partitions = nParts
	if busyRows != nil {
		env.BusyRows = *busyRows
	}
	if ownership != nil {
		env.Ownership = *ownership
	}
	// failover measures both ownerships unless --ownership names one.
	ownerships := []string{env.Ownership}
	if scenario == "failover" {
		explicit := e.getenv("OUTBOX_RELAY_OWNERSHIP") != ""
		fs.Visit(func(f *flag.Flag) { explicit = explicit || f.Name == "ownership" })
		if !explicit {
			ownerships = []string{relay.OwnRows, relay.OwnPartitions}
		}
	}

	one := func(r bench.Result, err error) ([]bench.Result, error) { return []bench.Result{r}, err }
	results, err := bench.Repeat(*runs, func() ([]bench.Result, error) {
		switch scenario {
		case "writers":
			return bench.Writers(ctx, env, bench.WritersConfig{Writers: writerCounts, Modes: modes, Duration: *duration, Poll: *poll, OffPoll: *offPoll})
		case "latency":
			return bench.Latency(ctx, env, *rate, *n, *mode, *baseline, bench.Horizon{Hold: *holdHorizon, Behind: *behind})
		case "drain":
			return one(bench.Drain(ctx, env, *n, *relays, *batch, *published, *baseline, *holdHorizon))
		case "consume":
			return one(bench.Consume(ctx, env, *n, *consumers, *batch, *dup, *effect, *baseline))
		case "failover":
			var out []bench.Result
			for _, o := range ownerships {
				fenv := env
				fenv.Ownership = o
				r, err := bench.Failover(ctx, fenv, *rate, *duration)
				if err != nil {
					return nil, err
				}
				out = append(out, r)
			}
			return out, nil
		default:
			return one(bench.Sustained(ctx, env, *rate, *duration, *mode))
		}
	})
	if err != nil {
		return err
	}
	bench.SetRatios(results)
	for i := range results {
		results[i].Settings["runs"] = *runs
	}
	if *asJSON {
		enc := json.NewEncoder(e.stdout)
		for _, r := range results {
			if err := enc.Encode(r); err != nil {
				return err
			}
		}
		return nil
	}
	return printBenchTable(e, results)
}

// printBenchTable prints one row per result: the contract's figures, then the
// scenario-specific ones and the settings.
func printBenchTable(e *env, results []bench.Result) error {
	const row = "%-26s %8s %10s %9s %9s %9s %9s  %s\n"
	fmt.Fprintf(e.stdout, row, "scenario", "n", "events/s", "p50 ms", "p90 ms", "p99 ms", "max ms", "")
	for _, r := range results {
		var notes []string
		if r.RatioToOff != nil {
			notes = append(notes, fmt.Sprintf("ratio_to_off=%.2f", *r.RatioToOff))
		}
		if r.RatioP50ToBaseline != nil {
			notes = append(notes, fmt.Sprintf("ratio_p50_to_baseline=%.2f ratio_p99_to_baseline=%.2f", *r.RatioP50ToBaseline, *r.RatioP99ToBaseline))
		}
		if r.RatioWithheld != nil {
			notes = append(notes, fmt.Sprintf("ratio_withheld=%q", *r.RatioWithheld))
		}
		if r.RatioToBaseline != nil {
			notes = append(notes, fmt.Sprintf("ratio_to_baseline=%.2f baseline_events_per_s=%.0f", *r.RatioToBaseline, *r.BaselineEventsPerS))
		}
		for _, f := range []struct {
			name string
			v    *int64
		}{
			{"errors", r.Errors}, {"backlog_at_end", r.BacklogAtEnd}, {"over_1s", r.OverOneS}, {"polls_with_work", r.PollsWithWork},
			{"max_backlog", r.MaxBacklog}, {"duplicates", r.Duplicates}, {"peak_rss_kb", r.PeakRSSKB}, {"rss_before_kb", r.RSSBeforeKB},
		} {
			if f.v != nil {
				notes = append(notes, fmt.Sprintf("%s=%d", f.name, *f.v))
			}
		}
		if r.MaxScheduleLagMs != nil {
			notes = append(notes, fmt.Sprintf("max_schedule_lag_ms=%.1f", *r.MaxScheduleLagMs))
		}
		if r.BacklogBounded != nil {
			notes = append(notes, fmt.Sprintf("backlog_bounded=%t", *r.BacklogBounded))
		}
		keys := make([]string, 0, len(r.Settings))
		for k := range r.Settings {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
			notes = append(notes, fmt.Sprintf("%s=%v", k, r.Settings[k]))
		}
		if len(r.Runs) > 0 {
			per := make([]string, len(r.Runs))
			for i, run := range r.Runs {
				per[i] = fmt.Sprintf("%.0f", run.EventsPerS)
			}
			notes = append(notes, "events/s of the runs="+strings.Join(per, "/"))
		}
		fmt.Fprintf(e.stdout, row, r.Scenario, strconv.Itoa(r.N), fmt.Sprintf("%.0f", r.EventsPerS), fmt.Sprintf("%.2f", r.P50Ms),
			fmt.Sprintf("%.2f", r.P90Ms), fmt.Sprintf("%.2f", r.P99Ms), fmt.Sprintf("%.2f", r.MaxMs), strings.Join(notes, " "))
	}
	return nil
}
