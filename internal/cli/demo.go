package cli

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/demo"
	"github.com/tedbank/outbox/internal/connect"
	"github.com/tedbank/outbox/internal/failpoint"
	"github.com/tedbank/outbox/internal/migrate"
	"github.com/tedbank/outbox/internal/testenv"
)

func runDemo(ctx context.Context, e *env, args []string) error {
	var c common
	fs := e.flags("demo", &c)
	short := fs.Bool("short", false, "a smaller burst (for CI)")
	partitions := partitionsFlag(e, fs, "the relays' and anti-fraud's partitions; with --redis-cluster the default is 4")
	if err := e.parse(fs, args); err != nil {
		return err
	}
	log, err := c.logger(e.stderr)
	if err != nil {
		return err
	}
	parts, err := partitions()
	if err != nil {
		return err
	}
	if c.redisCluster && !isSet(fs, "partitions") && e.getenv("OUTBOX_PARTITIONS") == "" {
		parts = 4
	}
	if c.redisCluster && parts < 2 {
		return usagef("--partitions %d: anti-fraud on a Redis Cluster needs at least 2 partitions", parts)
	}
	explicit := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { explicit[f.Name] = true })
	ownServers := !explicit["database-url"] && e.getenv("DATABASE_URL") == "" &&
		!explicit["redis-url"] && e.getenv("REDIS_URL") == ""

	streamPrefix, keyPrefix, ledgerPrefix := "outbox.event.", "fraud:", "ledger:"
	if ownServers {
		fmt.Fprintln(e.stdout, "No DATABASE_URL/REDIS_URL: starting throw-away PostgreSQL and Redis servers...")
		progress := func(msg string, args ...any) { log.Debug(msg, args...) }
		pg, err := testenv.Postgres(ctx, testenv.Options{Log: progress})
		if err != nil {
			return err
		}
		defer pg.Close()
		if c.redisCluster {
			fmt.Fprintln(e.stdout, "--redis-cluster: starting a throw-away Redis Cluster (3 masters, 3 replicas) from the local redis-server...")
			cl, err := testenv.LocalRedisCluster(ctx, testenv.Options{Log: progress})
			if err != nil {
				return err
			}
			defer cl.Close()
			fmt.Fprintf(e.stdout, "PostgreSQL (%s) and the Redis Cluster are up; they are removed when the demo ends.\n", pg.Source)
			c.databaseURL, c.redisURL = pg.URL, cl.URL
		} else {
			rd, err := testenv.Redis(ctx, testenv.Options{Log: progress})
			if err != nil {
				return err
			}
			defer rd.Close()
			fmt.Fprintf(e.stdout, "PostgreSQL (%s) and Redis (%s) are up; they are removed when the demo ends.\n", pg.Source, rd.Source)
			c.databaseURL, c.redisURL = pg.URL, rd.URL
		}
	} else {
		// Someone else's servers: keep the demo's keys apart and remove them
		// after, and its tables and rows in a database of its own on that
		// server, dropped after.
		run := uuid.NewString()[:8]
		streamPrefix, keyPrefix, ledgerPrefix = "demo-"+run+":outbox.event.", "demo-"+run+":fraud:", "demo-"+run+":ledger:"
		demoURL, drop, err := testenv.CreateDatabase(ctx, c.databaseURL, "outbox_demo")
		if err != nil {
			return fmt.Errorf("the demo runs in a database of its own on the server of --database-url (DATABASE_URL), "+
				"dropped at the end, and could not create one (its role needs CREATEDB; or unset DATABASE_URL and REDIS_URL "+
				"for throw-away servers): %w", err)
		}
		defer func() {
			if err := drop(context.WithoutCancel(ctx)); err != nil {
				log.Warn("could not drop the demo's database", "error", err)
			}
		}()
		fmt.Fprintf(e.stdout, "Using the servers of DATABASE_URL/REDIS_URL: the demo's tables go into a database of its own there (%s), "+
			"and its Redis keys under the prefix demo-%s:; both are removed when the demo ends.\n", databaseOf(demoURL), run)
		c.databaseURL = demoURL
	}

	pool, err := connect.Postgres(ctx, c.databaseURL, connect.PostgresOptions{AppName: "outbox-demo", MaxConns: 8})
	if err != nil {
		return err
	}
	defer pool.Close()
	if _, err := migrate.Up(ctx, pool); err != nil {
		return err
	}
	rdb, err := c.redis(ctx, connect.RedisOptions{ClientName: "outbox-demo"})
	if err != nil {
		return err
	}
	defer rdb.Close()
	if !ownServers {
		defer func() {
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			defer cancel()
			deleteKeys(cctx, rdb, streamPrefix+"*", keyPrefix+"*", ledgerPrefix+"*")
		}()
	}
	// The ledger's own database (scenario 6), on the same server, dropped
	// afterwards.
	ledgerURL, dropLedger, err := testenv.CreateDatabase(ctx, c.databaseURL, "outbox_demo_ledger")
	if err != nil {
		log.Warn("no database for the ledger (scenario 6 is not run): creating one needs CREATEDB", "error", err)
		ledgerURL = ""
	} else {
		defer func() { _ = dropLedger(context.WithoutCancel(ctx)) }()
	}

	quiet := slog.New(slog.DiscardHandler)
	if explicit["log-level"] || e.getenv("OUTBOX_LOG_LEVEL") != "" {
		quiet = log
	}
	return demo.Run(ctx, demo.Config{
		FailPoints: failpoint.Enabled, // scenario 2 runs this binary
		Pool:       pool, Redis: rdb, DatabaseURL: c.databaseURL, RedisURL: c.redisURL,
		StreamPrefix: streamPrefix, KeyPrefix: keyPrefix, Out: e.stdout, Logger: quiet,
		LedgerURL: ledgerURL, LedgerKeyPrefix: ledgerPrefix,
		Color: isTerminal(e.stdout), Short: *short, Cluster: c.redisCluster, Partitions: parts,
	})
}

// deleteKeys deletes the keys matching the patterns, on every master of a
// cluster.
func deleteKeys(ctx context.Context, rdb redis.UniversalClient, patterns ...string) {
	for _, pattern := range patterns {
		_ = connect.DeleteKeys(ctx, rdb, pattern)
	}
}

// isTerminal reports whether w is a terminal (colours and a redrawn progress
// bar), honouring NO_COLOR.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok || os.Getenv("NO_COLOR") != "" {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// databaseOf is the database a PostgreSQL URL names.
func databaseOf(url string) string {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return "?"
	}
	return cfg.Database
}
