// Package bench measures the outbox end to end on real servers, each
// scenario run in a database of its own (created, migrated and dropped) and
// under a Redis key prefix of its own (deleted afterwards):
//
//   - writers: settle throughput (transfer.Settle transactions per second)
//     and commit latency at several writer counts and notify modes, with a
//     relay running;
//   - latency: commit → stream entry (seen by a separate XREAD reader) and
//     commit → anti-fraud verdict, settling on an open-loop schedule;
//   - drain: how fast K relays publish a backlog of N events;
//   - consume: how fast K anti-fraud consumers process N preloaded stream
//     entries, duplicates included;
//   - sustained: settling at a fixed rate for a while with one relay and one
//     consumer: commit → verdict and whether the outbox backlog stays bounded.
//
// Every scenario returns Results; Repeat runs one several times and reports
// the median of each figure.
package bench

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer/natssource"
	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/connect"
	"github.com/tedbank/outbox/internal/migrate"
	"github.com/tedbank/outbox/internal/natsjs"
	"github.com/tedbank/outbox/internal/queries"
	"github.com/tedbank/outbox/internal/testenv"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/relay/natsbroker"
	"github.com/tedbank/outbox/relay/redisbroker"
)

// Result is one measurement; --json prints it as one line. The fields after
// Settings are scenario-specific and omitted where they do not apply.
type Result struct {
	Scenario   string         `json:"scenario"`
	N          int            `json:"n"`            // measurements (events, transactions) behind the figures
	Seconds    float64        `json:"seconds"`      // the timed phase
	EventsPerS float64        `json:"events_per_s"` // N / Seconds
	P50Ms      float64        `json:"p50_ms"`
	P90Ms      float64        `json:"p90_ms"`
	P99Ms      float64        `json:"p99_ms"`
	MaxMs      float64        `json:"max_ms"`
	Settings   map[string]any `json:"settings"`

	// writers: events_per_s divided by that of notify mode off at the same
	// writer count (1 for off itself).
	RatioToOff *float64 `json:"ratio_to_off,omitempty"`
	// writers, latency, sustained: settle calls that failed (not in N).
	Errors *int64 `json:"errors,omitempty"`
	// writers: events not yet published when the writers stopped.
	BacklogAtEnd *int64 `json:"backlog_at_end,omitempty"`
	// latency, sustained: how late the open-loop schedule started a TED at
	// worst (the writers could not keep up with --rate when this grows).
	MaxScheduleLagMs *float64 `json:"max_schedule_lag_ms,omitempty"`
	// latency, sustained: events slower than one second (max_ms says how
	// slow the worst was): a wake-up missed and left for the fallback poll,
	// or a stall.
	OverOneS *int64 `json:"over_1s,omitempty"`
	// latency: events of the warm-up before the timed phase slower than one
	// second (the percentiles and over_1s count the timed phase only).
	WarmUpOverOneS *int64 `json:"warm_up_over_1s,omitempty"`
	// writers, latency, sustained: fallback polls of the relay that found rows (each
	// is a batch of events that waited for the poll, not for a NOTIFY).
	PollsWithWork *int64 `json:"polls_with_work,omitempty"`
	// sustained: the largest outbox backlog (rows pending or publishing)
	// sampled every 100ms, and whether the backlog stayed bounded.
	MaxBacklog     *int64 `json:"max_backlog,omitempty"`
	BacklogBounded *bool  `json:"backlog_bounded,omitempty"`
	// consume: deliveries skipped as duplicates (N includes them).
	Duplicates *int64 `json:"duplicates,omitempty"`
	// consume: the minimal consumer (minimal.go) over as many entries of
	// the same shape, in the same run, and events_per_s over its.
	BaselineEventsPerS *float64 `json:"baseline_events_per_s,omitempty"`
	RatioToBaseline    *float64 `json:"ratio_to_baseline,omitempty"`
	// latency_commit_to_stream: p50_ms and p99_ms over those of the
	// minimal relay's run (latency_minimal_commit_to_stream), same run.
	RatioP50ToBaseline *float64 `json:"ratio_p50_to_baseline,omitempty"`
	RatioP99ToBaseline *float64 `json:"ratio_p99_to_baseline,omitempty"`
	// latency_commit_to_stream: why the two ratios above are absent: the
	// writers of either run fell short of the offered rate (below 90 %),
	// so the runs carried different loads. With --runs, the medians are
	// over the runs that have ratios, and this says in how many they were
	// withheld.
	RatioWithheld *string `json:"ratio_withheld,omitempty"`
	// drain, consume: peak resident set of the whole harness process during
	// the timed phase (VmHWM, reset just before it), and its RSS then.
	PeakRSSKB   *int64 `json:"peak_rss_kb,omitempty"`
	RSSBeforeKB *int64 `json:"rss_before_kb,omitempty"`

	// Runs holds every run's result when the case ran more than once; the
	// figures above are then the medians of theirs, except writers'
	// ratio_to_off, the ratio of the medians (SetRatios).
	Runs []Result `json:"runs,omitempty"`
}

// Env is where a scenario runs.
type Env struct {
	AdminURL string                // a PostgreSQL URL allowed to create databases
	Redis    redis.UniversalClient // one Redis, or a Redis Cluster client
	Log      *slog.Logger
	// MinReplicas is the relay's and the consumer's (latency scenario).
	MinReplicas int
	// Partitions is the relays' and consumers' (drain, consume, latency,
	// sustained); 0 means 1.
	Partitions int
	// Ownership is the relays' (relay.Config.Ownership); empty: the default
	// (relay.OwnAuto: partition leases on the bench's fresh databases).
	Ownership string
	// BusyRows is the relays' (relay.Config.BusyRows); 0: the default.
	BusyRows int
	// JS, when set, makes NATS JetStream the broker (drain, consume,
	// latency, sustained): each scenario publishes to a JetStream stream of
	// its own, deleted afterwards; Redis keeps the consumers' state.
	JS jetstream.JetStream
}

func (e Env) partitions() int { return max(e.Partitions, 1) }

// space is one scenario's database and key prefix.
type space struct {
	pool       *pgxpool.Pool // the writers' (and the harness's)
	prefix     string
	drop       func(context.Context) error
	rdb        redis.UniversalClient
	js         jetstream.JetStream // NATS JetStream is the broker (Env.JS)
	natsStream string              // the scenario's JetStream stream
	dbURL      string
	extra      []*pgxpool.Pool
}

// relayPool opens a pool of its own for one relay, as `outbox relay` has in
// production: sharing the writers' pool would queue the relay's claims behind
// hundreds of writers waiting for a connection.
func (s *space) relayPool(ctx context.Context) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(s.dbURL)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = "outbox-bench-relay"
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	s.extra = append(s.extra, pool)
	return pool, nil
}

func (e Env) open(ctx context.Context, name string, maxConns int32) (*space, error) {
	dbURL, drop, err := testenv.CreateDatabase(ctx, e.AdminURL, "bench_"+name)
	if err != nil {
		return nil, fmt.Errorf("create the benchmark database (the URL's user needs CREATEDB): %w", err)
	}
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		_ = drop(ctx)
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = "outbox-bench"
	cfg.MaxConns = max(maxConns, 8)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		_ = drop(ctx)
		return nil, err
	}
	if _, err := migrate.Up(ctx, pool); err != nil {
		pool.Close()
		_ = drop(ctx)
		return nil, err
	}
	s := &space{pool: pool, drop: drop, rdb: e.Redis, dbURL: dbURL, prefix: "bench-" + uuid.NewString()[:8] + ".", js: e.JS}
	if s.js != nil {
		s.natsStream = "BENCH_" + strings.ToUpper(strings.ReplaceAll(uuid.NewString()[:8], "-", ""))
		if _, err := natsjs.Ensure(ctx, s.js, natsjs.Stream{Name: s.natsStream, SubjectPrefix: s.prefix}); err != nil {
			s.close()
			return nil, err
		}
	}
	return s, nil
}

// broker names the scenario's broker in its settings.
func (s *space) broker() string {
	if s.js != nil {
		return "nats"
	}
	return "redis"
}

// newRelay returns a relay of the space's broker claiming from pool (rc
// configures Redis Streams).
func (s *space) newRelay(pool *pgxpool.Pool, cfg relay.Config, rc redisbroker.Config) (*relay.Relay, error) {
	if s.js != nil {
		return natsbroker.NewRelay(pool, natsbroker.Config{JS: s.js, Stream: s.natsStream}, cfg)
	}
	return redisRelay(pool, s.rdb, cfg, rc)
}

// redisRelay returns a relay claiming from pool and publishing to rdb.
func redisRelay(pool *pgxpool.Pool, rdb redisbroker.Pipeliner, cfg relay.Config, rc redisbroker.Config) (*relay.Relay, error) {
	rc.Logger = cfg.Logger
	b, err := redisbroker.New(rdb, rc)
	if err != nil {
		return nil, err
	}
	return relay.New(pool, b, cfg)
}

// newFraud returns an anti-fraud consumer reading the space's broker.
func (s *space) newFraud(cfg fraud.Config) (*fraud.Consumer, error) {
	if s.js != nil {
		return fraud.NewWithSource(s.rdb, natssource.New(s.js), cfg)
	}
	return fraud.New(s.rdb, cfg)
}

func (s *space) close() {
	for _, p := range s.extra {
		p.Close()
	}
	s.pool.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	_ = s.drop(ctx)
	if s.js != nil {
		_ = s.js.DeleteStream(ctx, s.natsStream)
	}
	if err := connect.DeleteKeys(ctx, s.rdb, s.prefix+"*"); err != nil {
		fmt.Fprintf(os.Stderr, "bench: some keys under %s* are left in Redis: %v\n", s.prefix, err)
	}
}

// backlog counts the rows not yet published (pending or publishing) with the
// metrics' query, which the schema keeps cheap (a partial index).
func (s *space) backlog(ctx context.Context) (int64, error) {
	var pending, publishing, dead int64
	var oldest, xact float64
	var retrying int
	q := queries.MetricsOutbox()
	err := s.pool.QueryRow(ctx, q.SQL, q.Args...).Scan(&pending, &publishing, &dead, &oldest, &retrying, &xact)
	return pending + publishing, err
}

// warm opens n pool connections before a timed phase, so that connecting is
// not measured.
func (s *space) warm(ctx context.Context, n int) error {
	conns := make([]*pgxpool.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			c.Release()
		}
	}()
	for range n {
		c, err := s.pool.Acquire(ctx)
		if err != nil {
			return err
		}
		conns = append(conns, c)
	}
	return nil
}

// percentiles fills a Result from latencies (nearest rank). n and the rate
// are len(xs) over took.
func percentiles(scenario string, xs []time.Duration, took time.Duration, settings map[string]any) Result {
	slices.Sort(xs)
	q := func(p float64) float64 {
		if len(xs) == 0 {
			return 0
		}
		i := int(math.Ceil(p*float64(len(xs)))) - 1
		return ms(xs[min(max(i, 0), len(xs)-1)])
	}
	r := Result{Scenario: scenario, N: len(xs), Seconds: took.Seconds(),
		P50Ms: q(0.5), P90Ms: q(0.9), P99Ms: q(0.99), MaxMs: q(1), Settings: settings}
	if took > 0 {
		r.EventsPerS = float64(len(xs)) / took.Seconds()
	}
	return r
}

// overOneSecond counts the latencies above one second.
func overOneSecond(xs []time.Duration) *int64 {
	var n int64
	for _, x := range xs {
		if x > time.Second {
			n++
		}
	}
	return &n
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func ptr[T any](v T) *T { return &v }

// Repeat runs a scenario runs times and combines the i-th results of every
// run: each figure becomes the median of the runs' (a boolean is true only
// if it is true in every run) and Runs lists the runs' own results. A
// scenario must return the same cases, in the same order, every run. Runs of
// a many-case scenario (writers) thus alternate its cases rather than
// repeating one case back to back.
func Repeat(runs int, scenario func() ([]Result, error)) ([]Result, error) {
	var all [][]Result
	for range max(runs, 1) {
		rs, err := scenario()
		if err != nil {
			return nil, err
		}
		if len(all) > 0 && len(rs) != len(all[0]) {
			return nil, fmt.Errorf("bench: run %d returned %d results, the first %d", len(all)+1, len(rs), len(all[0]))
		}
		all = append(all, rs)
	}
	if len(all) == 1 {
		return all[0], nil
	}
	out := make([]Result, len(all[0]))
	for i := range out {
		runs := make([]Result, len(all))
		for r := range all {
			runs[r] = all[r][i]
		}
		out[i] = combine(runs)
	}
	return out, nil
}

func combine(runs []Result) Result {
	c := runs[0]
	c.Settings = runs[0].Settings
	c.N = int(math.Round(median(runs, func(r Result) float64 { return float64(r.N) })))
	c.Seconds = median(runs, func(r Result) float64 { return r.Seconds })
	c.EventsPerS = median(runs, func(r Result) float64 { return r.EventsPerS })
	c.P50Ms = median(runs, func(r Result) float64 { return r.P50Ms })
	c.P90Ms = median(runs, func(r Result) float64 { return r.P90Ms })
	c.P99Ms = median(runs, func(r Result) float64 { return r.P99Ms })
	c.MaxMs = median(runs, func(r Result) float64 { return r.MaxMs })
	c.RatioToOff = medianPtr(runs, func(r Result) *float64 { return r.RatioToOff })
	c.MaxScheduleLagMs = medianPtr(runs, func(r Result) *float64 { return r.MaxScheduleLagMs })
	c.Errors = medianInt(runs, func(r Result) *int64 { return r.Errors })
	c.BacklogAtEnd = medianInt(runs, func(r Result) *int64 { return r.BacklogAtEnd })
	c.PollsWithWork = medianInt(runs, func(r Result) *int64 { return r.PollsWithWork })
	c.OverOneS = medianInt(runs, func(r Result) *int64 { return r.OverOneS })
	c.WarmUpOverOneS = medianInt(runs, func(r Result) *int64 { return r.WarmUpOverOneS })
	c.MaxBacklog = medianInt(runs, func(r Result) *int64 { return r.MaxBacklog })
	c.Duplicates = medianInt(runs, func(r Result) *int64 { return r.Duplicates })
	c.BaselineEventsPerS = medianPtr(runs, func(r Result) *float64 { return r.BaselineEventsPerS })
	c.RatioToBaseline = medianPtr(runs, func(r Result) *float64 { return r.RatioToBaseline })
	c.RatioP50ToBaseline = medianPtr(runs, func(r Result) *float64 { return r.RatioP50ToBaseline })
	c.RatioP99ToBaseline = medianPtr(runs, func(r Result) *float64 { return r.RatioP99ToBaseline })
	c.RatioWithheld = nil
	if withheld := countIf(runs, func(r Result) bool { return r.RatioWithheld != nil }); withheld > 0 {
		c.RatioWithheld = ptr(fmt.Sprintf("withheld in %d of %d runs (each run's ratio_withheld says why)", withheld, len(runs)))
	}
	c.PeakRSSKB = medianInt(runs, func(r Result) *int64 { return r.PeakRSSKB })
	c.RSSBeforeKB = medianInt(runs, func(r Result) *int64 { return r.RSSBeforeKB })
	if runs[0].BacklogBounded != nil {
		all := true
		for _, r := range runs {
			all = all && r.BacklogBounded != nil && *r.BacklogBounded
		}
		c.BacklogBounded = &all
	}
	c.Runs = make([]Result, len(runs))
	for i, r := range runs {
		r.Runs = nil
		c.Runs[i] = r
	}
	return c
}

// median of f over runs.
func median(runs []Result, f func(Result) float64) float64 {
	xs := make([]float64, len(runs))
	for i, r := range runs {
		xs[i] = f(r)
	}
	return medianOf(xs)
}

// medianPtr is the median of f over the runs where it is set (nil in none).
func medianPtr(runs []Result, f func(Result) *float64) *float64 {
	var xs []float64
	for _, r := range runs {
		if p := f(r); p != nil {
			xs = append(xs, *p)
		}
	}
	if len(xs) == 0 {
		return nil
	}
	return ptr(medianOf(xs))
}

// medianOf is the middle value of xs (not empty; sorted in place), or the
// mean of the two middle values of an even count.
func medianOf(xs []float64) float64 {
	slices.Sort(xs)
	m := len(xs) / 2
	if len(xs)%2 == 1 {
		return xs[m]
	}
	return (xs[m-1] + xs[m]) / 2
}

func countIf(runs []Result, f func(Result) bool) int {
	n := 0
	for _, r := range runs {
		if f(r) {
			n++
		}
	}
	return n
}

func medianInt(runs []Result, f func(Result) *int64) *int64 {
	m := medianPtr(runs, func(r Result) *float64 {
		if p := f(r); p != nil {
			return ptr(float64(*p))
		}
		return nil
	})
	if m == nil {
		return nil
	}
	return ptr(int64(math.Round(*m)))
}
