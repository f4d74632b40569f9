package cli

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/connect"
	"github.com/tedbank/outbox/internal/metrics"
	"github.com/tedbank/outbox/internal/traceexport"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/relay/broker"
	"github.com/tedbank/outbox/relay/natsbroker"
	"github.com/tedbank/outbox/relay/redisbroker"
)

func runRelay(ctx context.Context, e *env, args []string) error {
	var c common
	var (
		cfg relay.Config
		rc  redisbroker.Config // Redis Streams
		ce  broker.CloudEvents // either broker
	)
	fs := e.flags("relay", &c)
	wait := waitFlag(fs)
	fs.StringVar(&cfg.Name, "name", "", "relay name, recorded in claimed_by (default hostname-pid)")
	fs.IntVar(&cfg.BatchSize, "batch", relay.DefaultBatchSize, "rows per claim and per pipelined publish")
	fs.Int64Var(&cfg.BatchBytes, "batch-bytes", relay.DefaultBatchBytes, "bound a batch by payload bytes as well: the smallest events first while the bytes before each stay under this (at least one event)")
	fs.StringVar(&cfg.Ownership, "ownership", envOr(e.getenv, "OUTBOX_RELAY_OWNERSHIP", relay.OwnAuto),
		"how relays divide the outbox: rows (claim each row), partitions (lease slots of partition keys; every relay of a database must use the same), or auto: the ownership of the relays running on the database, rows while a row claimer may still run unseen (after a PostgreSQL restart), else partitions (env OUTBOX_RELAY_OWNERSHIP)")
	fs.DurationVar(&cfg.Lease, "lease", relay.DefaultLease, "claim lease, and partition lease when the relay leases partitions; expired claims are returned to pending")
	fs.DurationVar(&cfg.PollInterval, "poll", relay.DefaultPollInterval, "fallback poll interval (NOTIFY wakes the relay sooner)")
	busyPace := fs.Duration("busy-pace", 0, "deprecated, no effect: a busy relay claims again at once after a small batch (a pause cost latency and bought nothing measurable)")
	fs.IntVar(&cfg.BusyRows, "busy-rows", relay.DefaultBusyRows, "tell writers to stop notifying while draining once claims find this many rows within 20 ms (or one claim after the first of a drain does, or a full batch)")
	fs.DurationVar(&cfg.PublishTimeout, "publish-timeout", 0, "timeout of one pipelined publish (default min(5s, lease/2))")
	fs.IntVar(&cfg.MaxAttempts, "max-attempts", relay.DefaultMaxAttempts, "failed attempts after which an event is dead")
	fs.DurationVar(&cfg.BackoffBase, "backoff-base", relay.DefaultBackoffBase, "an event whose publish failed is retried after about this, then twice as long after each failure, up to --backoff-max (with jitter: half to all of it); with --max-attempts this is how long an event that keeps failing takes to go dead: 4-9 minutes with the defaults")
	fs.DurationVar(&cfg.BackoffMax, "backoff-max", relay.DefaultBackoffMax, "the longest wait before an event's next attempt (see --backoff-base)")
	fs.DurationVar(&cfg.Redelivery, "redelivery-window", 0, "how long after an event may first have reached the broker (unmarked) it may be published again; after it the event goes dead. 0: max-attempts × (lease + reap + publish timeout + backoff max), 58m by default. The consumers' --relay-redelivery must be at least this")
	fs.StringVar(&cfg.StreamPrefix, "stream-prefix", relay.DefaultStreamPrefix, "stream key prefix; the key is <prefix><aggregate_type>")
	fs.StringVar(&cfg.Stream, "stream", "", "publish every event to this one stream instead")
	fs.BoolVar(&ce.Enabled, "cloudevents", false, "also write each event's CloudEvents 1.0 attributes, binary mode: ce_id, ce_type, ce_source, ce_time, ce_specversion, ce_partitionkey, content-type (and the NATS binding's ce-* headers on JetStream)")
	fs.StringVar(&ce.Source, "cloudevents-source", "", "the ce_source attribute with --cloudevents (default /outbox/<aggregate_type>)")
	fs.Int64Var(&rc.StreamMaxLen, "stream-maxlen", 0, "cap each stream near this many entries, never trimming what a consumer group still needs (0 = no cap)")
	fs.DurationVar(&rc.StreamRetention, "stream-retention", redisbroker.DefaultStreamRetention, "trim entries older than this that every consumer group has acknowledged, never what a group still needs (0 = keep every entry; with --stream-maxlen alone, no age cap)")
	minReplicas := minReplicasFlag(e, fs, "mark an event published only once this many Redis replicas have its entry (WAIT); unconfirmed entries are retried without spending an attempt")
	partitions := partitionsFlag(e, fs, "split each stream into this many partition streams, by partition key (the sender account for TEDs)")
	allowEvicting := allowEvictingFlag(e, fs)
	fs.DurationVar(&rc.ReplicaTimeout, "replica-timeout", 0, "longest wait for --min-replicas per publish (default min(1s, publish timeout/2))")
	metricsAddr := fs.String("metrics-addr", "", "serve /metrics, /healthz and /readyz on this address, e.g. :9464 (off when empty)")
	brokerFlag := brokerFlags(e, fs)
	natsStream, natsDuplicates, natsMaxAge := natsStreamFlags(fs)
	listenURL := fs.String("listen-database-url", e.getenv("LISTEN_DATABASE_URL"),
		"PostgreSQL URL of the LISTEN connection, when --database-url goes through a pooler in transaction mode: a direct or session-pooled connection (env LISTEN_DATABASE_URL; default --database-url)")
	if err := e.parse(fs, args); err != nil {
		return err
	}
	log, err := c.logger(e.stderr)
	if err != nil {
		return err
	}
	if err := brokerFlag.check(); err != nil {
		return err
	}
	if brokerFlag.nats() {
		for _, redisOnly := range []string{"min-replicas", "replica-timeout", "stream-maxlen", "stream-retention", "redis-cluster"} {
			if isSet(fs, redisOnly) {
				return usagef("--%s is about Redis Streams: not with --broker nats (the JetStream stream's --nats-max-age bounds it)", redisOnly)
			}
		}
	}
	if *listenURL != "" {
		if cfg.ListenConfig, err = connect.PostgresConfig(*listenURL, "outbox-relay-listen"); err != nil {
			return usageError{err.Error()}
		}
	}
	if cfg.BatchSize <= 0 || cfg.BatchBytes <= 0 || cfg.Lease <= 0 || cfg.PollInterval <= 0 || cfg.MaxAttempts <= 0 || cfg.BusyRows <= 0 || cfg.PublishTimeout < 0 || *busyPace < 0 {
		return usagef("--batch, --batch-bytes, --lease, --poll, --max-attempts and --busy-rows must be positive, --publish-timeout and --busy-pace not negative")
	}
	if cfg.BackoffBase <= 0 || cfg.BackoffMax < cfg.BackoffBase {
		return usagef("--backoff-base %s, --backoff-max %s: the base must be positive and not above the max", cfg.BackoffBase, cfg.BackoffMax)
	}
	if rc.MinReplicas, err = minReplicas(); err != nil {
		return err
	}
	if cfg.Partitions, err = partitions(); err != nil {
		return err
	}
	if rc.AllowEvictingRedis, err = allowEvicting(); err != nil {
		return err
	}
	if *busyPace > 0 {
		log.Warn("--busy-pace is deprecated and has no effect: a busy relay claims again at once after a small batch",
			slog.Duration("busy_pace", *busyPace))
	}
	switch {
	case rc.StreamRetention < 0 || rc.StreamMaxLen < 0:
		return usagef("--stream-retention and --stream-maxlen must not be negative")
	case rc.StreamRetention == 0, rc.StreamMaxLen > 0 && !isSet(fs, "stream-retention"):
		rc.StreamRetention = -1 // no age cap (redisbroker.Config: negative)
	}
	cfg.Logger, rc.Logger = log, log
	if err := cfg.Validate(); err != nil {
		return usageError{err.Error()}
	}
	if err := ce.Validate(); err != nil {
		return usageError{fmt.Sprintf("%v: %v", relay.ErrConfig, err)}
	}
	publishTimeout := cfg.WithDefaults().PublishTimeout
	switch {
	case rc.ReplicaTimeout == 0:
		rc.ReplicaTimeout = min(time.Second, publishTimeout/2)
	case rc.MinReplicas > 0 && (rc.ReplicaTimeout < time.Millisecond || rc.ReplicaTimeout >= publishTimeout):
		return usagef("--replica-timeout %s: must be at least 1ms and shorter than the publish timeout %s", rc.ReplicaTimeout, publishTimeout)
	}
	rc.CloudEvents = ce

	pool, err := waitFor(ctx, log, *wait, func() (*pgxpool.Pool, error) {
		return openOutbox(ctx, c.databaseURL, connect.PostgresOptions{AppName: "outbox-relay", MaxConns: 4})
	})
	if err != nil {
		return err
	}
	defer connect.ClosePool(pool, 3*time.Second)
	var newRelay func() (*relay.Relay, error)
	if brokerFlag.nats() {
		nc, js, err := waitForNATS(ctx, log, *wait, brokerFlag, "outbox-relay")
		if err != nil {
			return err
		}
		defer nc.Close()
		newRelay = func() (*relay.Relay, error) {
			return natsbroker.NewRelay(pool, natsbroker.Config{JS: js, Stream: *natsStream, Duplicates: *natsDuplicates,
				MaxAge: *natsMaxAge, CloudEvents: ce}, cfg)
		}
	} else {
		rdb, err := waitFor(ctx, log, *wait, func() (redis.UniversalClient, error) {
			return c.redis(ctx, connect.RedisOptions{ClientName: "outbox-relay", NoRetries: true})
		})
		if err != nil {
			return err
		}
		defer rdb.Close()
		newRelay = func() (*relay.Relay, error) {
			b, err := redisbroker.New(rdb, rc)
			if err != nil {
				return nil, fmt.Errorf("%w: %w", relay.ErrConfig, err)
			}
			return relay.New(pool, b, cfg)
		}
	}
	stopTracing, err := traceexport.Setup(ctx, "outbox-relay", log)
	if err != nil {
		return err
	}
	defer stopTracing(context.WithoutCancel(ctx))
	reg := metrics.NewRegistry()
	if *metricsAddr != "" {
		cfg.Metrics = relay.NewMetrics(reg)
		if !brokerFlag.nats() {
			rc.Metrics = redisbroker.NewMetrics(reg)
		}
		reg.MustRegister(relay.NewOutboxCollector(pool))
	}
	r, err := newRelay()
	if err != nil {
		return usageError{err.Error()}
	}
	return serveAndRun(ctx, *metricsAddr, reg, r, log)
}

// minReplicasFlag defines --min-replicas, defaulting to OUTBOX_MIN_REPLICAS;
// the returned function reads it after parsing.
func minReplicasFlag(e *env, fs *flag.FlagSet, usage string) func() (int, error) {
	v := fs.String("min-replicas", e.getenv("OUTBOX_MIN_REPLICAS"), usage+" (env OUTBOX_MIN_REPLICAS; default 0: do not wait)")
	return func() (int, error) {
		if *v == "" {
			return 0, nil
		}
		n, err := strconv.Atoi(*v)
		if err != nil || n < 0 {
			return 0, usagef("--min-replicas %q (or OUTBOX_MIN_REPLICAS): want a whole number of replicas, 0 or more", *v)
		}
		return n, nil
	}
}
