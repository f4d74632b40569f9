package cli

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"runtime"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/consumer/inbox"
	"github.com/tedbank/outbox/consumer/natssource"
	"github.com/tedbank/outbox/internal/connect"
	"github.com/tedbank/outbox/internal/metrics"
	"github.com/tedbank/outbox/internal/traceexport"
	"github.com/tedbank/outbox/ledger"
	"github.com/tedbank/outbox/transfer"
)

// ledgerDatabaseFlag defines --ledger-database-url (env LEDGER_DATABASE_URL):
// the ledger example's own database.
func ledgerDatabaseFlag(e *env, fs *flag.FlagSet, usage string) *string {
	return fs.String("ledger-database-url", e.getenv("LEDGER_DATABASE_URL"), usage+" (env LEDGER_DATABASE_URL)")
}

// openLedger connects to the ledger's database and migrates it (the
// ledger's tables and the inbox's); the caller closes the pool.
func openLedger(ctx context.Context, url, app string) (*pgxpool.Pool, error) {
	if url == "" {
		return nil, usagef("--ledger-database-url (or LEDGER_DATABASE_URL) is required: the ledger keeps its entries and its inbox in a database of its own")
	}
	db, err := connect.Postgres(ctx, url, connect.PostgresOptions{AppName: app, MaxConns: 8})
	if err != nil {
		return nil, err
	}
	if err := ledger.Migrate(ctx, db); err != nil {
		db.Close()
		return nil, fmt.Errorf("migrate the ledger's database: %w", err)
	}
	return db, nil
}

func runLedger(ctx context.Context, e *env, args []string) error {
	if len(args) > 0 && args[0] == "balances" {
		return runLedgerBalances(ctx, e, args[1:])
	}
	var c common
	var cfg ledger.Config
	cc := &cfg.Consumer
	fs := e.flags("ledger", &c)
	wait := waitFlag(fs)
	usageLine(fs, `outbox ledger [flags]          run the ledger example's consumer (double entries in its own PostgreSQL)
       outbox ledger balances [flags] print the ledger's balances (see 'outbox ledger balances -h')`)
	ledgerURL := ledgerDatabaseFlag(e, fs, "the ledger's own PostgreSQL: its entries and its inbox (migrated at start)")
	fs.StringVar(&cc.Stream, "stream", ledger.DefaultStream, "stream to consume")
	fs.StringVar(&cc.Group, "group", ledger.DefaultGroup, "consumer group")
	fs.StringVar(&cc.KeyPrefix, "key-prefix", "ledger:", "prefix of the Redis keys the consumer writes (leases, dead letters)")
	fs.StringVar(&cc.Consumer, "consumer", "", "consumer name, stable across restarts (default hostname)")
	fs.IntVar(&cc.BatchSize, "batch", consumer.DefaultBatchSize, "entries per read: one transaction each")
	fs.IntVar(&cc.MaxBatchSize, "max-batch", 0, "entries per read under a backlog: a full read doubles the next one up to this; equal to --batch, every read stays at --batch (default 5 × --batch, at most 10000)")
	fs.DurationVar(&cc.Block, "block", consumer.DefaultBlock, "how long a read waits for new entries before it comes back empty")
	fs.DurationVar(&cc.ClaimInterval, "claim-interval", consumer.DefaultClaimInterval, "how often to claim entries of dead consumers")
	fs.DurationVar(&cc.ClaimMinIdle, "claim-min-idle", consumer.DefaultClaimMinIdle, "idle time after which an entry is claimed")
	fs.IntVar(&cc.MaxDeliveries, "max-deliveries", consumer.DefaultMaxDeliveries, "deliveries before an unprocessable entry is dead-lettered")
	fs.DurationVar(&cc.PartitionLease, "partition-lease", consumer.DefaultPartitionLease, "how long this consumer's hold on a partition lasts unrenewed")
	fs.DurationVar(&cc.RelayRedelivery, "relay-redelivery", consumer.DefaultRelayRedelivery, "how long after its first publication a relay may publish an event again (attempts × (lease + reap + backoff)); the inbox retention must exceed it")
	fs.DurationVar(&cfg.Inbox.Retention, "inbox-retention", inbox.DefaultRetention, "how long processed event ids stay in the inbox")
	partitions := partitionsFlag(e, fs, "the partitions of the stream, as the relay splits it")
	allowEvicting := allowEvictingFlag(e, fs)
	metricsAddr := fs.String("metrics-addr", "", "serve /metrics, /healthz and /readyz on this address, e.g. :9466 (off when empty)")
	broker := brokerFlags(e, fs)
	if err := e.parse(fs, args); err != nil {
		return err
	}
	log, err := c.logger(e.stderr)
	if err != nil {
		return err
	}
	if err := broker.check(); err != nil {
		return err
	}
	if cc.Partitions, err = partitions(); err != nil {
		return err
	}
	if cc.AllowEvictingRedis, err = allowEvicting(); err != nil {
		return err
	}
	if cc.BatchSize <= 0 || cc.MaxBatchSize < 0 || cc.Block <= 0 || cc.ClaimInterval <= 0 || cc.ClaimMinIdle <= 0 || cc.MaxDeliveries <= 0 ||
		cc.PartitionLease <= 0 || cc.RelayRedelivery <= 0 || cfg.Inbox.Retention <= 0 {
		return usagef("every numeric flag and duration must be positive")
	}
	cc.Logger, cfg.Inbox.Logger = log, log
	cc.Name = "ledger"
	if err := cc.Validate(); err != nil {
		return usageError{err.Error()}
	}
	db, err := waitFor(ctx, log, *wait, func() (*pgxpool.Pool, error) { return openLedger(ctx, *ledgerURL, "outbox-ledger") })
	if err != nil {
		return err
	}
	defer db.Close()
	// A worker per owned partition blocks a connection in XREADGROUP, and
	// under a backlog holds a second one (its read-ahead beside its effects).
	pool := max(10*runtime.GOMAXPROCS(0), 2*cc.Partitions+8)
	rdb, err := waitFor(ctx, log, *wait, func() (redis.UniversalClient, error) {
		return c.redis(ctx, connect.RedisOptions{ClientName: "outbox-ledger", PoolSize: pool})
	})
	if err != nil {
		return err
	}
	defer rdb.Close()
	stopTracing, err := traceexport.Setup(ctx, "outbox-ledger", log)
	if err != nil {
		return err
	}
	defer stopTracing(context.WithoutCancel(ctx))
	reg := metrics.NewRegistry()
	collector := consumer.NewGroupCollector(rdb, "ledger", cc.Stream, cc.Group).WithPartitions(cc.Partitions)
	newConsumer := func() (*consumer.Consumer, error) { return ledger.New(db, rdb, cfg) }
	if broker.nats() {
		nc, js, err := waitForNATS(ctx, log, *wait, broker, "outbox-ledger")
		if err != nil {
			return err
		}
		defer nc.Close()
		collector.WithSource(natssource.New(js))
		newConsumer = func() (*consumer.Consumer, error) { return ledger.NewWithSource(db, rdb, natssource.New(js), cfg) }
	}
	if *metricsAddr != "" {
		cc.Metrics = consumer.NewMetrics(reg, "ledger", "")
		reg.MustRegister(collector)
	}
	cons, err := newConsumer()
	if err != nil {
		return usageError{err.Error()}
	}
	return serveAndRun(ctx, *metricsAddr, reg, cons, log)
}

func runLedgerBalances(ctx context.Context, e *env, args []string) error {
	fs := e.flags("ledger balances", nil)
	ledgerURL := ledgerDatabaseFlag(e, fs, "the ledger's own PostgreSQL")
	asJSON := fs.Bool("json", false, "print JSON: [{\"account\":...,\"balance_cents\":N,\"entries\":N}, ...]")
	if err := e.parse(fs, args); err != nil {
		return err
	}
	db, err := openLedger(ctx, *ledgerURL, "outbox-ledger-balances")
	if err != nil {
		return err
	}
	defer db.Close()
	bs, err := ledger.Balances(ctx, db)
	if err != nil {
		return err
	}
	if *asJSON {
		if bs == nil {
			bs = []ledger.Balance{}
		}
		return json.NewEncoder(e.stdout).Encode(bs)
	}
	var sum int64
	for _, b := range bs {
		fmt.Fprintf(e.stdout, "%-24s %16s  (%d entries)\n", b.Account, "R$ "+transfer.FormatBRL(b.BalanceCents), b.Entries)
		sum += b.BalanceCents
	}
	fmt.Fprintf(e.stdout, "%d accounts; the balances sum to R$ %s (every debit has its credit)\n", len(bs), transfer.FormatBRL(sum))
	return nil
}
