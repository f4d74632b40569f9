package cli

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"runtime"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/consumer/natssource"
	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/connect"
	"github.com/tedbank/outbox/internal/metrics"
	"github.com/tedbank/outbox/internal/traceexport"
	"github.com/tedbank/outbox/partition"
	"github.com/tedbank/outbox/transfer"
)

func fraudFlags(e *env, name string, c *common, cfg *fraud.Config) *flag.FlagSet {
	fs := e.flags(name, c)
	fs.StringVar(&cfg.Stream, "stream", fraud.DefaultStream, "stream to consume")
	fs.StringVar(&cfg.Group, "group", fraud.DefaultGroup, "consumer group")
	fs.StringVar(&cfg.KeyPrefix, "key-prefix", fraud.DefaultKeyPrefix, "prefix of every key the consumer writes")
	return fs
}

func runFraud(ctx context.Context, e *env, args []string) error {
	if len(args) > 0 && args[0] == "report" {
		return runFraudReport(ctx, e, args[1:])
	}
	if len(args) > 0 && args[0] == "dlq" {
		return runFraudDLQ(ctx, e, args[1:])
	}
	var c common
	var cfg fraud.Config
	fs := fraudFlags(e, "fraud", &c, &cfg)
	wait := waitFlag(fs)
	usageLine(fs, `outbox fraud [flags]        run the anti-fraud consumer
       outbox fraud report [flags] anti-fraud totals (see 'outbox fraud report -h')
       outbox fraud dlq <list|retry> [flags]
                                   the consumer's dead letters (see 'outbox fraud dlq -h')`)
	fs.StringVar(&cfg.Consumer, "consumer", "", "consumer name, stable across restarts (default hostname)")
	fs.IntVar(&cfg.BatchSize, "batch", fraud.DefaultBatchSize, "entries per read")
	fs.IntVar(&cfg.MaxBatchSize, "max-batch", 0, "entries per read under a backlog: a full read doubles the next one up to this; equal to --batch, every read stays at --batch (default 5 × --batch, at most 10000)")
	fs.DurationVar(&cfg.Block, "block", fraud.DefaultBlock, "how long a read waits for new entries before it comes back empty")
	fs.DurationVar(&cfg.ClaimInterval, "claim-interval", fraud.DefaultClaimInterval, "how often to claim entries of dead consumers")
	fs.DurationVar(&cfg.ClaimMinIdle, "claim-min-idle", fraud.DefaultClaimMinIdle, "idle time after which an entry is claimed")
	fs.IntVar(&cfg.MaxDeliveries, "max-deliveries", fraud.DefaultMaxDeliveries, "deliveries before an unprocessable entry is dead-lettered")
	fs.DurationVar(&cfg.DedupeTTL, "dedupe-ttl", fraud.DefaultDedupeTTL, "how long processed event ids are remembered")
	fs.DurationVar(&cfg.RelayRedelivery, "relay-redelivery", consumer.DefaultRelayRedelivery, "how long after its first publication a relay may publish an event again (attempts × (lease + reap + backoff)); --dedupe-ttl must exceed it")
	fs.Int64Var(&cfg.AmountLimitCents, "amount-limit", fraud.DefaultAmountLimitCents, "review a TED above this amount (cents)")
	fs.Int64Var(&cfg.WindowLimitCents, "window-limit", fraud.DefaultWindowLimitCents, "review when a sender's total over the window passes this (cents)")
	fs.DurationVar(&cfg.Window, "window", fraud.DefaultWindow, "velocity window")
	fs.DurationVar(&cfg.Retention, "retention", fraud.DefaultRetention, "how long verdicts, daily sender totals and review alerts are kept (after the end of the settlement day); bounds Redis memory")
	minReplicas := minReplicasFlag(e, fs, "acknowledge an entry only once this many Redis replicas have its effect (WAIT); unconfirmed entries stay pending and are retried")
	partitions := partitionsFlag(e, fs, "the partitions of the stream, as the relay splits it; the group's consumers divide them among themselves")
	allowEvicting := allowEvictingFlag(e, fs)
	fs.DurationVar(&cfg.PartitionLease, "partition-lease", fraud.DefaultPartitionLease, "how long this consumer's hold on a partition lasts unrenewed: a dead consumer's partitions move within it")
	fs.IntVar(&cfg.AuditLen, "audit-len", 0, "keep a stream per partition of the effects in the order applied (<prefix>audit), about this many entries each; 0 keeps none")
	fs.DurationVar(&cfg.ReplicaTimeout, "replica-timeout", time.Second, "longest wait for --min-replicas per batch")
	metricsAddr := fs.String("metrics-addr", "", "serve /metrics, /healthz and /readyz on this address, e.g. :9465 (off when empty)")
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
	if cfg.MinReplicas, err = minReplicas(); err != nil {
		return err
	}
	if cfg.Partitions, err = partitions(); err != nil {
		return err
	}
	if cfg.AllowEvictingRedis, err = allowEvicting(); err != nil {
		return err
	}
	if cfg.BatchSize <= 0 || cfg.MaxBatchSize < 0 || cfg.Block <= 0 || cfg.ClaimInterval <= 0 || cfg.ClaimMinIdle <= 0 ||
		cfg.MaxDeliveries <= 0 || cfg.DedupeTTL <= 0 || cfg.AmountLimitCents <= 0 || cfg.WindowLimitCents <= 0 || cfg.Window <= 0 || cfg.Retention <= 0 || cfg.PartitionLease <= 0 {
		return usagef("every numeric flag and duration must be positive")
	}
	cfg.Logger = log
	if err := cfg.Validate(); err != nil {
		return usageError{err.Error()}
	}
	name := cfg.Consumer
	if name == "" {
		name = "default"
	}
	// A worker per owned partition blocks a connection in XREADGROUP, and
	// under a backlog holds a second one (its read-ahead beside its effects).
	pool := max(10*runtime.GOMAXPROCS(0), 2*cfg.Partitions+8)
	rdb, err := waitFor(ctx, log, *wait, func() (redis.UniversalClient, error) {
		return c.redis(ctx, connect.RedisOptions{ClientName: "outbox-fraud-" + name, PoolSize: pool})
	})
	if err != nil {
		return err
	}
	defer rdb.Close()
	stopTracing, err := traceexport.Setup(ctx, "outbox-fraud", log)
	if err != nil {
		return err
	}
	defer stopTracing(context.WithoutCancel(ctx))
	reg := metrics.NewRegistry()
	collector := fraud.NewGroupCollector(rdb, cfg.Stream, cfg.Group).WithPartitions(cfg.Partitions)
	newConsumer := func() (*fraud.Consumer, error) { return fraud.New(rdb, cfg) }
	if broker.nats() {
		// Events come from JetStream; the effects stay in Redis.
		nc, js, err := waitForNATS(ctx, log, *wait, broker, "outbox-fraud-"+name)
		if err != nil {
			return err
		}
		defer nc.Close()
		collector.WithSource(natssource.New(js))
		newConsumer = func() (*fraud.Consumer, error) { return fraud.NewWithSource(rdb, natssource.New(js), cfg) }
	}
	if *metricsAddr != "" {
		cfg.Metrics = fraud.NewMetrics(reg)
		reg.MustRegister(collector)
	}
	cons, err := newConsumer()
	if err != nil {
		return usageError{err.Error()}
	}
	return serveAndRun(ctx, *metricsAddr, reg, cons, log)
}

func runFraudReport(ctx context.Context, e *env, args []string) error {
	var c common
	var cfg fraud.Config
	fs := e.flags("fraud report", &c)
	fs.StringVar(&cfg.KeyPrefix, "key-prefix", fraud.DefaultKeyPrefix, "prefix of every key the consumer writes")
	partitions := partitionsFlag(e, fs, "the partitions the consumers' state is split into (the report sums them)")
	asJSON := fs.Bool("json", false, "print JSON")
	if err := e.parse(fs, args); err != nil {
		return err
	}
	var err error
	if cfg.Partitions, err = partitions(); err != nil {
		return err
	}
	if _, err := c.logger(e.stderr); err != nil {
		return err
	}
	rdb, err := c.redis(ctx, connect.RedisOptions{ClientName: "outbox-fraud-report"})
	if err != nil {
		return err
	}
	defer rdb.Close()
	rep, err := fraud.ReadReport(ctx, rdb, fraud.Keys{Prefix: cfg.KeyPrefix, Partitions: cfg.Partitions})
	if err != nil {
		return err
	}
	if *asJSON {
		return json.NewEncoder(e.stdout).Encode(rep)
	}
	var sent int64
	for _, a := range rep.Accounts {
		sent += a.SentCents
	}
	fmt.Fprintf(e.stdout, "verdicts %d (review %d), duplicates skipped %d, dead-lettered %d; over the retained days: %d sender accounts, R$ %s sent\n",
		rep.Verdicts, rep.Reviews, rep.DuplicatesSkipped, rep.DeadLettered, len(rep.Accounts), transfer.FormatBRL(sent))
	return nil
}

// partitionsFlag defines --partitions, which defaults to OUTBOX_PARTITIONS
// and then 1; the returned function checks the value after parsing.
func partitionsFlag(e *env, fs *flag.FlagSet, usage string) func() (int, error) {
	v := fs.String("partitions", e.getenv("OUTBOX_PARTITIONS"), usage+
		" (env OUTBOX_PARTITIONS; default 1: one stream under its plain name); relays and consumers of a deployment must agree (docs/operations.md)")
	return func() (int, error) {
		if *v == "" {
			return 1, nil
		}
		n, err := strconv.Atoi(*v)
		if err != nil || partition.Validate(n) != nil {
			return 0, usagef("--partitions %q (or OUTBOX_PARTITIONS): want a whole number from 1 to %d", *v, partition.Max)
		}
		return n, nil
	}
}

// allowEvictingFlag defines --allow-evicting-redis, defaulting to
// OUTBOX_ALLOW_EVICTING_REDIS; the returned function reads it after parsing.
func allowEvictingFlag(e *env, fs *flag.FlagSet) func() (bool, error) {
	v := fs.String("allow-evicting-redis", e.getenv("OUTBOX_ALLOW_EVICTING_REDIS"),
		"start even if Redis evicts keys under memory pressure (a maxmemory-policy other than noeviction, on any node): "+
			"dedupe markers can then be evicted and a redelivered event take effect twice (env OUTBOX_ALLOW_EVICTING_REDIS; default false: refuse)")
	return func() (bool, error) {
		if *v == "" {
			return false, nil
		}
		b, err := strconv.ParseBool(*v)
		if err != nil {
			return false, usagef("--allow-evicting-redis %q (or OUTBOX_ALLOW_EVICTING_REDIS): want true or false", *v)
		}
		return b, nil
	}
}
