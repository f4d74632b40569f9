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
// chaos_test.go for the flags); docs/reliability.md describes the suite, docs/log.md has the results of its runs.
package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
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
	// NATS runs the relays and consumers on NATS JetStream (--broker nats,
	// nats.go): a nats-server of the run's own, killed and restarted
	// (nats-kill, nats-restart) and blackholed among the other faults;
	// anti-fraud's effects stay in Redis.
	NATS bool
	// Ownership is the relays' --ownership (rows, partitions or auto); empty:
	// the relay's default (auto: partitions, on the suite's fresh database).
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
	// A relay or consumer stopped (SIGSTOP) with its connections
	// open, then continued; a relay's and consumers' PostgreSQL sessions
	// terminated again and again.
	Stall  = "stall"
	PGFlap = "pg-flap"
	// 18 MiB of big payloads from a SQL writer; a long
	// transaction holding the horizon while a backlog drains; Redis back
	// without its last seconds, repaired with reconcile and republish
	// (datafaults.go).
	BigPayloads = "big-payloads"
	LongTx      = "long-tx"
	RedisLoss   = "redis-loss"
	// On a Redis Cluster (cluster.go).
	MasterKill    = "master-kill"
	MasterStop    = "master-stop"
	Reshard       = "reshard"
	ConsumerJoin  = "consumer-join"
	ConsumerLeave = "consumer-leave"
	// On NATS JetStream (nats.go).
	NATSKill    = "nats-kill"
	NATSRestart = "nats-restart"
)

// Kinds lists every kind of fault on a single Redis; ClusterKinds on a
// Redis Cluster.
var (
	Kinds        = []string{KillRelay, KillConsumer, Failpoint, PGTerminate, RedisClientKill, Blackhole, PGRestart, RedisKill, RedisOOM, BusyError, Stall, PGFlap, BigPayloads, LongTx, RedisLoss}
	ClusterKinds = []string{KillRelay, KillConsumer, Failpoint, PGTerminate, PGRestart, BusyError, MasterKill, MasterStop, Reshard, ConsumerJoin, ConsumerLeave, Stall, PGFlap, BigPayloads, LongTx}
	// NATSKinds on NATS JetStream: the relays never touch Redis (no busy
	// error, no OOM for them), the consumers keep their effects there.
	// A Redis loss is not among them: the stream is in NATS.
	NATSKinds = []string{KillRelay, KillConsumer, Failpoint, PGTerminate, RedisClientKill, Blackhole, PGRestart, RedisKill, NATSKill, NATSRestart, Stall, PGFlap, BigPayloads, LongTx}
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
// events, stranded.go). A half-open LISTEN connection is found by the
// relay's watch (a round trip every 250ms that must answer within 2s); the
// poll delivers meanwhile, and the stranded analysis counts that time as the
// fault's (its bound, backLimit, still allows the older ping's 25s).
// Debug logs: the analysis reads when each relay's LISTEN is up ("listening").
//
// The relays say "busy" (writers stop notifying) from the second claim in a
// row that finds any rows (--busy-rows 1) instead of 8: the bursts here are
// a few hundred TEDs a second, and 8 rows per claim round trip takes
// thousands a second, more than 2 cores sustain beside the suite. The busy
// state's faults (busy errors, hand-over probes) need it; the threshold
// only decides when a relay enters that state, not what it does there.
//
// Two partitions on a single Redis: each of the two consumers owns one, so a
// fault on either hits a consumer at work, and a killed one's partition
// moves (to the other, or back to it when it is restarted under its name).
// Sixteen on a cluster, spread over the three masters (run.parts).
//
// The consumers keep an audit stream of their effects (--audit-len), from
// which verify checks each sender's order.
var (
	relayArgs = []string{"--lease", "5s", "--busy-rows", "1", "--log-level", "debug"}
	fraudArgs = []string{"--claim-min-idle", "5s", "--claim-interval", "1s", "--audit-len", "1000000"}
	// ledgerArgs: the inbox path's consumers (ledger.go).
	ledgerArgs = []string{"--claim-min-idle", "5s", "--claim-interval", "1s"}
	// settleAccounts is how many accounts outbox settle draws the TEDs
	// between (its default).
	settleAccounts = 100
)

// run is the state of one run.
type run struct {
	cfg  Config
	rng  *rand.Rand
	logf func(format string, args ...any)

	pg, rds           *testenv.Server
	cluster           *testenv.Cluster // instead of rds in cluster mode
	nats              *testenv.Server  // NATS mode's nats-server
	natsProxy         *tcpproxy.Proxy  // in front of it, for blackholes
	proxyNATS         string           // its URL through the proxy
	nc                *nats.Conn       // the monitor's, straight to the server
	js                jetstream.JetStream
	parts             int // the relays' and consumers' --partitions
	dbURL, dbName     string
	pgProxy, rdsProxy *tcpproxy.Proxy
	relayDB, proxyRDS string // URLs through the proxies (proxyRDS: the cluster's URL)
	mon               *pgxpool.Pool
	rdb               redis.UniversalClient
	procs             []*proc
	relays, consumers []*proc
	ledgers           []*proc       // the inbox path's consumers (ledger.go)
	ledgerDB          *pgxpool.Pool // their database
	flaky             int           // accounts made flaky for the ledger (ledger.go)
	joined            int           // consumers started by consumer-join faults
	// relayArgs, fraudArgs: the package's, with the mode's.
	relayArgs, fraudArgs []string

	settleDone chan struct{}
	settleRuns int
	// mustFireLeft counts the planned faults that test something only
	// when traffic makes them fire (mustFire) not injected yet: while any
	// is left, the load keeps its last TEDs for them (load.go, reserve).
	mustFireLeft atomic.Int32
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
	blobBursts int  // big-payloads faults so far
	// bg: what a fault left running after it ended (a long transaction
	// held open while its backlog drains); waited for before the checks.
	bg       sync.WaitGroup
	restarts int // relays restarted by rolling deploys

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
	res.Seed, res.Cluster, res.Ownership, res.NATS = cfg.Seed, cfg.Cluster, cfg.Ownership, cfg.NATS
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
	r.mustFireLeft.Store(1) // until injectFaults has its plan
	go r.settleLoop(loadCtx)
	go r.flakyLoop(loadCtx, settleAccounts)
	monCtx, cancelMon := context.WithCancel(ctx)
	defer cancelMon()
	go r.progress(monCtx)

	r.injectFaults(ctx)
	select {
	case <-r.settleDone:
	case <-ctx.Done():
		return res, ctx.Err()
	}
	r.bg.Wait()
	r.waitDrain(ctx)
	r.stopAll()
	cancelMon()
	r.verify(ctx, &res)
	r.stranded(ctx, &res)
	r.failover(ctx, &res)

	r.mu.Lock()
	res.Faults = slices.Clone(r.faults)
	res.Restarts = r.restarts
	res.Problems = append(res.Problems, r.problems...)
	res.Details = append(res.Details, r.details...)
	r.mu.Unlock()
	for _, f := range res.Faults {
		res.MaxRecovery = max(res.MaxRecovery, f.Recovery)
	}
	res.Problems = append(res.Problems, res.unfired()...)
	res.Duration = time.Since(start)
	return res, nil
}
