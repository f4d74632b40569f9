package chaos

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// quietLogger drops go-redis's internal log lines.
type quietLogger struct{}

func (quietLogger) Printf(context.Context, string, ...any) {}

var (
	enabled   = flag.Bool("chaos", false, "run the fault-injection suite (slow; skipped without this flag)")
	n         = flag.Int("chaos.n", 5000, "TEDs to settle")
	rate      = flag.Float64("chaos.rate", 0, "TEDs per second (default: 40, or 25 with -chaos.short and -chaos.ownership rows; on a cluster 15, or 9: its own faults come first and take longer, and the fail points and busy errors after them need the load still running)")
	seed      = flag.Uint64("chaos.seed", 0, "seed of the fault schedule (0: random; the seed is printed for replay)")
	short     = flag.Bool("chaos.short", false, "each kind of fault once, shorter outages (CI)")
	keep      = flag.Bool("chaos.keep", false, "keep the run's directory of logs even when it passes")
	binary    = flag.String("chaos.binary", "", "outbox binary to test instead of building ./cmd/outbox (e.g. one built from a deliberately broken copy)")
	redisArgs = flag.String("chaos.redis-args", "", "redis-server arguments instead of the default persistence settings, e.g. '--appendonly no' (to watch the suite fail)")
	cluster   = flag.Bool("chaos.cluster", false, "run on a local Redis Cluster (3 masters, 3 replicas) with 16 partitions and the cluster's faults")
	minRepl   = flag.Int("chaos.min-replicas", 1, "with -chaos.cluster: the relays' and consumers' --min-replicas (0 shows the loss it prevents)")
	ownership = flag.String("chaos.ownership", "rows", "the relays' --ownership: rows or partitions (auto, the relay's default, chooses partitions on the suite's fresh database)")
	onNATS    = flag.Bool("chaos.nats", false, "run the relays and consumers on NATS JetStream (--broker nats) with the server's own faults (nats-kill, nats-restart, blackholes); the effects stay in Redis")
)

func TestChaos(t *testing.T) {
	if !*enabled {
		t.Skip("fault-injection suite: run with -chaos (make chaos)")
	}
	// The monitor's cluster client logs every failed dial to a killed node.
	redis.SetLogger(quietLogger{})
	cfg := Config{N: *n, Rate: *rate, Seed: *seed, Short: *short, Concurrency: 4, Binary: *binary, Cluster: *cluster, MinReplicas: *minRepl, Ownership: *ownership, NATS: *onNATS}
	if cfg.Rate == 0 {
		switch {
		case cfg.Cluster && cfg.Short:
			cfg.Rate = 9
		case cfg.Cluster:
			cfg.Rate = 15
		case cfg.Short && cfg.Ownership == "rows":
			// Partition owners (and auto, which leases partitions on the
			// suite's fresh database) say "busy" only at a higher rate
			// (each drains its share): the busy-error faults would wait
			// for it past the load, and the fail points after them fire
			// on none.
			cfg.Rate = 25
		default:
			cfg.Rate = 40
		}
	}
	if cfg.Seed == 0 {
		cfg.Seed = uint64(time.Now().UnixNano())
	}
	if *redisArgs != "" {
		cfg.RedisArgs = strings.Fields(*redisArgs)
	}
	dir, err := os.MkdirTemp("", "outbox-chaos-")
	if err != nil {
		t.Fatal(err)
	}
	cfg.Dir = dir
	cfg.Logf = func(format string, args ...any) { t.Logf(format, args...) }
	mode := "one Redis"
	if cfg.Cluster {
		mode = fmt.Sprintf("a Redis Cluster, --min-replicas %d", cfg.MinReplicas)
	}
	if cfg.NATS {
		mode = "NATS JetStream (effects in one Redis)"
	}
	if cfg.Ownership != "" {
		mode += ", relays with --ownership " + cfg.Ownership
	}
	t.Logf("chaos: seed %d (replay the fault schedule with -chaos.seed %d), %d TEDs at %.0f/s on %s, logs in %s", cfg.Seed, cfg.Seed, cfg.N, cfg.Rate, mode, dir)

	ctx, cancel := context.WithTimeout(context.Background(), 18*time.Minute)
	defer cancel()
	res, err := Run(ctx, cfg)
	for _, f := range res.Faults {
		back := "?"
		if !f.Back.IsZero() {
			back = fmt.Sprintf("%5.2fs", f.Back.Sub(f.End).Seconds())
		}
		t.Logf("fault %-17s %-28s recovery %6.2fs  back %s  %s", f.Kind, f.Detail, f.Recovery.Seconds(), back, f.Note)
	}
	for _, k := range res.ByKind() {
		t.Log(k)
	}
	for _, d := range res.Details {
		t.Log(d)
	}
	fmt.Println(res.Summary())
	if err != nil || len(res.Problems) > 0 {
		t.Logf("logs kept in %s; their tails:\n%s", dir, LogTails(dir, 40))
		if err != nil {
			t.Fatalf("chaos: set-up failed: %v", err)
		}
		t.Fatalf("chaos: %d problems (seed %d):\n  %s", len(res.Problems), cfg.Seed, strings.Join(res.Problems, "\n  "))
	}
	if *keep {
		t.Logf("logs kept in %s", dir)
	} else {
		_ = os.RemoveAll(dir)
	}
}
