// Package chaos is the fault-injection suite of the outbox: thousands of TEDs
// are settled at a steady rate while two relays and two anti-fraud consumers
// (the real outbox binary, as separate processes) are killed at random and
// at their exact dangerous points, their PostgreSQL sessions and Redis
// connections are cut, their connections are blackholed, PostgreSQL is
// stopped and restarted, Redis is SIGKILLed and restarted and is made to
// refuse writes. Then, with PostgreSQL as the source of truth, it checks that
// every transfer has exactly one event, every event was published, anti-fraud
// applied every effect exactly once, nothing is left pending, and every
// process exits 0 on SIGTERM.
//
// The suite owns its servers: a PostgreSQL and a Redis started from local
// binaries in a temporary directory (internal/testenv), never shared ones.
// Run it with `make chaos` or `go test ./internal/chaos -chaos` (see
// chaos_test.go for the flags); docs/reliability.md has the results.
package chaos

import (
	"cmp"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/tcpproxy"
	"github.com/tedbank/outbox/internal/testenv"
)

// Config says how big a run is and how it is seeded.
type Config struct {
	N           int     // TEDs to settle
	Rate        float64 // TEDs per second
	Concurrency int     // settle --concurrency
	Seed        uint64  // seeds every random choice of faults and timings
	// Short injects each kind of fault (and each fail point) once, with
	// shorter outages, for CI; without it faults keep coming until the load
	// is settled.
	Short bool
	// Binary is the outbox binary to run; built into Dir when empty.
	Binary string
	// Dir holds every log of the run; it must exist.
	Dir string
	// RedisArgs are redis-server arguments (of every node of a cluster);
	// empty means DefaultRedisArgs.
	RedisArgs []string
	// Cluster runs the suite on a Redis Cluster of 3 masters and 3 replicas
	// (cluster.go): relays and consumers with --redis-cluster, 16
	// partitions and MinReplicas, and the cluster's own faults (a master
	// SIGKILLed or stopped past the node timeout and its replica promoted,
	// slots resharded, consumers joining and leaving) instead of the single
	// Redis's.
	Cluster     bool
	MinReplicas int
	// Ownership is the relays' --ownership (rows or partitions); empty:
	// the relay's default.
	Ownership string
	// Logf receives progress lines.
	Logf func(format string, args ...any)
}

// DefaultRedisArgs are the persistence settings under which a SIGKILL of
// Redis loses nothing the outbox marked published (docs/reliability.md).
var DefaultRedisArgs = []string{"--appendonly", "yes", "--appendfsync", "always", "--maxmemory-policy", "noeviction"}

// postgresArgs: testenv's servers run with synchronous_commit=off, under
// which a crash of PostgreSQL can lose commits that other sessions (the relay)
// already saw and published. The outbox needs durable commits.
//
// track_commit_timestamp: the stranded-event analysis (stranded.go) reads
// each settle transaction's commit time.
var postgresArgs = []string{"-c", "synchronous_commit=on", "-c", "track_commit_timestamp=on"}

// Kinds of fault, in the order of the summary line.
const (
	KillRelay       = "kill-relay"
	KillConsumer    = "kill-consumer"
	Failpoint       = "failpoint"
	PGTerminate     = "pg-terminate"
	RedisClientKill = "redis-client-kill"
	Blackhole       = "blackhole"
	PGRestart       = "pg-restart"
	RedisKill       = "redis-kill"
	RedisOOM        = "redis-oom"
	BusyError       = "busy-error"
	// On a Redis Cluster (cluster.go).
	MasterKill    = "master-kill"
	MasterStop    = "master-stop"
	Reshard       = "reshard"
	ConsumerJoin  = "consumer-join"
	ConsumerLeave = "consumer-leave"
)

// Kinds lists every kind of fault on a single Redis; ClusterKinds on a
// Redis Cluster.
var (
	Kinds        = []string{KillRelay, KillConsumer, Failpoint, PGTerminate, RedisClientKill, Blackhole, PGRestart, RedisKill, RedisOOM, BusyError}
	ClusterKinds = []string{KillRelay, KillConsumer, Failpoint, PGTerminate, PGRestart, BusyError, MasterKill, MasterStop, Reshard, ConsumerJoin, ConsumerLeave}
)

// RollingDeploy is not a fault: every relay in turn is stopped with SIGTERM
// and started again, as a deploy does. It opens no fault window, so the
// events committed meanwhile are judged by the stranded analysis: a relay
// that stops gracefully must hand its wake-ups over to the others.
const RollingDeploy = "rolling-deploy"

// Failpoints are the relay's and the consumer's dangerous points.
var Failpoints = []string{"relay.after-claim", "relay.after-xadd", "fraud.after-read", "fraud.after-effect"}

// Relay and consumer settings of the run: a short lease and claim idle time
// so that a claim or a delivery abandoned by a killed process comes back in
// seconds rather than the production defaults' 30s.
//
// The relays poll at the default interval (5s), as in production: a shorter
// poll would hide events that wait for it instead of being woken (stranded
// events, stranded.go). It also means a half-open LISTEN connection is found
// only after four quiet polls and a ping (about 25s); the poll delivers
// meanwhile, and the stranded analysis counts that time as the fault's.
// Debug logs: the analysis reads when each relay's LISTEN is up ("listening").
//
// Two partitions on a single Redis: each of the two consumers owns one, so a
// fault on either hits a consumer at work, and a killed one's partition
// moves (to the other, or back to it when it is restarted under its name).
// Sixteen on a cluster, spread over the three masters (run.parts).
//
// The consumers keep an audit stream of their effects (--audit-len), from
// which verify checks each sender's order.
var (
	relayArgs = []string{"--lease", "5s", "--log-level", "debug"}
	fraudArgs = []string{"--claim-min-idle", "5s", "--claim-interval", "1s", "--audit-len", "1000000"}
)

// FaultRecord is one injected fault.
type FaultRecord struct {
	Kind     string
	Detail   string
	Start    time.Time
	End      time.Time     // when the fault stopped being injected
	Recovery time.Duration // from End until the pipeline caught up (-1: never)
	// Back: when the relays' wake-up path was back after the fault; the
	// fault's window in the stranded analysis is [Start, Back] (stranded.go).
	Back time.Time
	// UnderLoad: settle was still producing TEDs when the fault began.
	UnderLoad bool
	Note      string
}

// Result is what a run found.
type Result struct {
	Seed                           uint64
	Transfers, Events, Verdicts    int
	Lost, Doubled                  int
	Faults                         []FaultRecord
	MaxRecovery                    time.Duration
	Duration                       time.Duration
	Problems                       []string // every failed check; empty means the run passed
	Details                        []string // diagnostics worth printing
	StreamEntries, DuplicatesInRed int
	// Stranded events (stranded.go): of the Judged events, committed in
	// calm phases, how many were published more than a second after their
	// commit, and the longest commit-to-publish delay among them.
	Judged, Stranded int
	WorstCalm        time.Duration
	// Restarts counts the relays restarted gracefully by rolling deploys.
	Restarts int
	// Probes counts the hand-over probes (probe.go); ProbesExact those in
	// which the other relays slept throughout, so that only the stopping
	// relay's hand-over could publish the probe's TED in time.
	Probes, ProbesExact int
	// Cluster: the run was on a Redis Cluster; OutOfOrder counts the
	// senders whose effects the audit shows applied out of settled order.
	Cluster    bool
	OutOfOrder int
	// Ownership: the relays' --ownership.
	Ownership string
}

// kinds is the fault kinds of the run's mode.
func (r Result) kinds() []string {
	if r.Cluster {
		return ClusterKinds
	}
	return Kinds
}

// Summary is the one line a run prints.
func (r Result) Summary() string {
	counts := map[string]int{}
	for _, f := range r.Faults {
		counts[f.Kind]++
	}
	var fs []string
	for _, k := range r.kinds() {
		fs = append(fs, fmt.Sprintf("%s:%d", k, counts[k]))
	}
	mode := "single"
	if r.Cluster {
		mode = "cluster"
	}
	// New fields go at the end: scripts read this line.
	return fmt.Sprintf("chaos: seed=%d transfers=%d events=%d verdicts=%d lost=%d doubled=%d stranded=%d judged=%d worst_calm_ms=%d faults=%s restarts=%d probes=%d/%d max_recovery=%.1fs duration=%.0fs out_of_order=%d mode=%s ownership=%s",
		r.Seed, r.Transfers, r.Events, r.Verdicts, r.Lost, r.Doubled, r.Stranded, r.Judged, r.WorstCalm.Milliseconds(), strings.Join(fs, ","),
		r.Restarts, r.ProbesExact, r.Probes, r.MaxRecovery.Seconds(), r.Duration.Seconds(), r.OutOfOrder, mode, cmp.Or(r.Ownership, "rows"))
}

// ByKind summarizes the faults per kind: how many, how many while the load
// was running, and the longest recovery.
func (r Result) ByKind() []string {
	type agg struct {
		n, underLoad int
		maxRec       time.Duration
		never        int
	}
	m := map[string]*agg{}
	for _, f := range r.Faults {
		a := m[f.Kind]
		if a == nil {
			a = &agg{}
			m[f.Kind] = a
		}
		a.n++
		if f.UnderLoad {
			a.underLoad++
		}
		if f.Recovery < 0 {
			a.never++
		}
		a.maxRec = max(a.maxRec, f.Recovery)
	}
	var out []string
	for _, k := range r.kinds() {
		a := m[k]
		if a == nil {
			out = append(out, fmt.Sprintf("%-17s 0", k))
			continue
		}
		out = append(out, fmt.Sprintf("%-17s %3d injected, %3d under load, max recovery %5.1fs, never recovered %d", k, a.n, a.underLoad, a.maxRec.Seconds(), a.never))
	}
	return out
}

// run is the state of one run.
type run struct {
	cfg  Config
	rng  *rand.Rand
	logf func(format string, args ...any)

	pg, rds           *testenv.Server
	cluster           *testenv.Cluster // instead of rds in cluster mode
	parts             int              // the relays' and consumers' --partitions
	dbURL, dbName     string
	pgProxy, rdsProxy *tcpproxy.Proxy
	relayDB, proxyRDS string // URLs through the proxies (proxyRDS: the cluster's URL)
	mon               *pgxpool.Pool
	rdb               redis.UniversalClient
	procs             []*proc
	relays, consumers []*proc
	joined            int // consumers started by consumer-join faults
	// relayArgs, fraudArgs: the package's, with the mode's.
	relayArgs, fraudArgs []string

	settleDone chan struct{}
	settleRuns int
	// The load's phases (load.go), drawn from loadRng (the settle loop's
	// own: rand.Rand is not safe for concurrent use).
	loadRng      *rand.Rand
	burstNow     chan struct{}
	burstStarted chan struct{} // a burst is starting (for rolling deploys)
	deployBurst  chan struct{}
	// A deploy's burst in progress: burstCut kills its settle run,
	// burstEnded is closed when that run has ended (cutBurst).
	burstCut      context.CancelFunc
	burstEnded    chan struct{}
	probes        []*probe // hand-over probes whose writer committed (probe.go)
	bursts, lulls int
	loadStart     time.Time
	// firstEntry is the id of the first stream entry of each event id.
	firstEntry map[string]string
	stuck      bool // a fault never recovered
	restarts   int  // relays restarted by rolling deploys

	mu       sync.Mutex
	faults   []FaultRecord
	problems []string
	details  []string
}

func (r *run) problem(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	msg := fmt.Sprintf(format, args...)
	r.problems = append(r.problems, msg)
	r.logf("PROBLEM: %s", msg)
}

func (r *run) detail(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	msg := fmt.Sprintf(format, args...)
	r.details = append(r.details, msg)
	r.logf("%s", msg)
}

// Run runs the suite. The error is for set-up failures; the checks' verdict
// is in Result.Problems.
func Run(ctx context.Context, cfg Config) (res Result, err error) {
	if cfg.N <= 0 || cfg.Rate <= 0 || cfg.Dir == "" {
		return res, fmt.Errorf("chaos: N, Rate and Dir are required")
	}
	if cfg.Concurrency <= 0 {
		cfg.Concurrency = 4
	}
	if cfg.Logf == nil {
		cfg.Logf = func(string, ...any) {}
	}
	if len(cfg.RedisArgs) == 0 {
		cfg.RedisArgs = DefaultRedisArgs
	}
	start := time.Now()
	r := &run{
		cfg: cfg, rng: rand.New(rand.NewPCG(cfg.Seed, cfg.Seed^0x9e3779b97f4a7c15)),
		logf: func(format string, args ...any) {
			cfg.Logf("%s %s", time.Now().Format("15:04:05.000"), fmt.Sprintf(format, args...))
		},
		settleDone:   make(chan struct{}),
		loadRng:      rand.New(rand.NewPCG(cfg.Seed^0x5bd1e995, cfg.Seed)),
		burstNow:     make(chan struct{}, 1),
		burstStarted: make(chan struct{}, 1),
		deployBurst:  make(chan struct{}, 1),
		firstEntry:   map[string]string{},
	}
	res.Seed, res.Cluster, res.Ownership = cfg.Seed, cfg.Cluster, cfg.Ownership
	r.parts = 2
	if cfg.Cluster {
		r.parts = 16
	}
	defer r.teardown()
	if err := r.setup(ctx); err != nil {
		return res, err
	}

	loadCtx, cancelLoad := context.WithCancel(ctx)
	defer cancelLoad()
	r.loadStart = time.Now()
	go r.settleLoop(loadCtx)
	monCtx, cancelMon := context.WithCancel(ctx)
	defer cancelMon()
	go r.progress(monCtx)

	r.injectFaults(ctx)
	select {
	case <-r.settleDone:
	case <-ctx.Done():
		return res, ctx.Err()
	}
	r.waitDrain(ctx)
	r.stopAll()
	cancelMon()
	r.verify(ctx, &res)
	r.stranded(ctx, &res)

	r.mu.Lock()
	res.Faults = slices.Clone(r.faults)
	res.Restarts = r.restarts
	res.Problems = append(res.Problems, r.problems...)
	res.Details = append(res.Details, r.details...)
	r.mu.Unlock()
	for _, f := range res.Faults {
		res.MaxRecovery = max(res.MaxRecovery, f.Recovery)
	}
	res.Duration = time.Since(start)
	return res, nil
}

func (r *run) setup(ctx context.Context) error {
	if r.cfg.Binary == "" {
		r.cfg.Binary = filepath.Join(r.cfg.Dir, "outbox")
		r.logf("building the outbox binary")
		out, err := exec.CommandContext(ctx, "go", "build", "-tags", "failpoint", "-o", r.cfg.Binary, "github.com/tedbank/outbox/cmd/outbox").CombinedOutput()
		if err != nil {
			return fmt.Errorf("go build: %v\n%s", err, out)
		}
	}
	var err error
	r.pg, err = testenv.LocalPostgres(ctx, testenv.Options{ExtraArgs: postgresArgs})
	if err != nil {
		return err
	}
	if r.cfg.Cluster {
		if r.cluster, err = testenv.LocalRedisCluster(ctx, testenv.Options{ExtraArgs: r.cfg.RedisArgs}); err != nil {
			return err
		}
		r.logf("postgres %s (dir %s), redis cluster %s %v", r.pg.URL, r.pg.Dir(), r.cluster.URL, r.cfg.RedisArgs)
	} else {
		if r.rds, err = testenv.LocalRedis(ctx, testenv.Options{ExtraArgs: r.cfg.RedisArgs}); err != nil {
			return err
		}
		r.logf("postgres %s (dir %s), redis %s %v (dir %s)", r.pg.URL, r.pg.Dir(), r.rds.URL, r.cfg.RedisArgs, r.rds.Dir())
	}
	r.dbURL, _, err = testenv.CreateDatabase(ctx, r.pg.URL, "chaos")
	if err != nil {
		return err
	}
	out, err := exec.CommandContext(ctx, r.cfg.Binary, "migrate", "--database-url", r.dbURL).CombinedOutput()
	if err != nil {
		return fmt.Errorf("outbox migrate: %v\n%s", err, out)
	}

	pgAddr := hostPort(r.pg.URL)
	if r.pgProxy, err = tcpproxy.Start(pgAddr); err != nil {
		return err
	}
	r.relayDB = strings.Replace(r.dbURL, pgAddr, r.pgProxy.Addr(), 1)
	if r.mon, err = monitorPool(ctx, r.dbURL); err != nil {
		return err
	}
	common := []string{"--partitions", strconv.Itoa(r.parts)}
	relayOnly := []string{}
	if r.cfg.Ownership != "" {
		relayOnly = append(relayOnly, "--ownership", r.cfg.Ownership)
	}
	if r.cfg.Cluster {
		// The nodes' own addresses: a cluster client follows the addresses
		// the cluster gives out, so a proxy in front would be bypassed.
		r.proxyRDS = r.cluster.URL
		common = append(common, "--redis-cluster", "--min-replicas", strconv.Itoa(r.cfg.MinReplicas))
		o, err := redis.ParseClusterURL(r.cluster.URL)
		if err != nil {
			return err
		}
		o.ClientName = "chaos-monitor"
		o.DialTimeout, o.ReadTimeout, o.WriteTimeout = time.Second, 2*time.Second, 2*time.Second
		r.rdb = redis.NewClusterClient(o)
	} else {
		rdsAddr := hostPort(r.rds.URL)
		if r.rdsProxy, err = tcpproxy.Start(rdsAddr); err != nil {
			return err
		}
		r.proxyRDS = strings.Replace(r.rds.URL, rdsAddr, r.rdsProxy.Addr(), 1)
		o, err := redis.ParseURL(r.rds.URL)
		if err != nil {
			return err
		}
		o.ClientName = "chaos-monitor"
		o.MaxRetries = 1
		o.DialTimeout, o.ReadTimeout, o.WriteTimeout = time.Second, 2*time.Second, 2*time.Second
		r.rdb = redis.NewClient(o)
	}
	r.relayArgs, r.fraudArgs = slices.Concat(relayArgs, common, relayOnly), slices.Concat(fraudArgs, common)

	for _, name := range []string{"r1", "r2"} {
		args := append([]string{"relay", "--name", name, "--database-url", r.relayDB, "--redis-url", r.proxyRDS}, r.relayArgs...)
		r.relays = append(r.relays, newProc(name, r.cfg.Binary, filepath.Join(r.cfg.Dir, name+".log"), r.logf, args...))
	}
	for _, name := range []string{"c1", "c2"} {
		args := append([]string{"fraud", "--consumer", name, "--redis-url", r.proxyRDS}, r.fraudArgs...)
		r.consumers = append(r.consumers, newProc(name, r.cfg.Binary, filepath.Join(r.cfg.Dir, name+".log"), r.logf, args...))
	}
	r.procs = append(append([]*proc{}, r.relays...), r.consumers...)
	for _, p := range r.procs {
		go p.supervise()
	}
	// Let every process come up before the load starts.
	deadline := time.Now().Add(30 * time.Second)
	for _, p := range r.procs {
		for !p.ready() {
			if time.Now().After(deadline) {
				return fmt.Errorf("%s did not start; see %s", p.name, p.logPath)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return nil
}

// teardown stops whatever is still running and keeps the servers' logs.
func (r *run) teardown() {
	for _, p := range r.procs {
		p.mu.Lock()
		p.stopping = true
		if p.aliveLocked() {
			_ = killGroup(p.cmd.Process.Pid)
		}
		p.mu.Unlock()
		<-p.loopDone
	}
	if r.mon != nil {
		r.mon.Close()
	}
	if r.rdb != nil {
		_ = r.rdb.Close()
	}
	for _, px := range []*tcpproxy.Proxy{r.pgProxy, r.rdsProxy} {
		if px != nil {
			_ = px.Close()
		}
	}
	servers := map[string]*testenv.Server{"postgres.log": r.pg, "redis.log": r.rds}
	if r.cluster != nil {
		for i, n := range r.cluster.Nodes {
			servers[fmt.Sprintf("redis-node-%d.log", i)] = n
		}
	}
	for name, s := range servers {
		if s == nil {
			continue
		}
		if b, err := os.ReadFile(s.LogPath()); err == nil {
			_ = os.WriteFile(filepath.Join(r.cfg.Dir, name), b, 0o644)
		}
		_ = s.Close()
	}
}

// stopAll sends SIGTERM to every process and requires each to exit 0 within
// termGrace.
func (r *run) stopAll() {
	var wg sync.WaitGroup
	for _, p := range r.procs {
		wg.Go(func() {
			took, err := p.terminate(true)
			if err != nil {
				r.problem("SIGTERM: %v", err)
				return
			}
			r.logf("%s exited 0 %s after SIGTERM", p.name, took.Round(time.Millisecond))
		})
	}
	wg.Wait()
	for _, p := range r.procs {
		<-p.loopDone
		exits, problems, n := p.report()
		var parts []string
		for k, v := range exits {
			parts = append(parts, fmt.Sprintf("%s:%d", k, v))
		}
		sort.Strings(parts)
		r.detail("%s: %d incarnations, exits %s", p.name, n, strings.Join(parts, ","))
		for _, pr := range problems {
			r.problem("%s", pr)
		}
	}
}

// LogTails returns the last lines of every log in dir, for a failed run.
func LogTails(dir string, lines int) string {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, e := range entries {
		if e.IsDir() || !strings.HasSuffix(e.Name(), ".log") {
			continue
		}
		data, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			continue
		}
		all := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
		fmt.Fprintf(&b, "----- %s (last %d of %d lines) -----\n", e.Name(), min(lines, len(all)), len(all))
		b.WriteString(strings.Join(all[max(0, len(all)-lines):], "\n"))
		b.WriteString("\n")
	}
	return b.String()
}
