package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/connect"
	"github.com/tedbank/outbox/internal/metrics"
	"github.com/tedbank/outbox/internal/migrate"
	"github.com/tedbank/outbox/internal/tracing"
	"github.com/tedbank/outbox/partition"
	"github.com/tedbank/outbox/relay"
	outboxsql "github.com/tedbank/outbox/sql"
	"github.com/tedbank/outbox/transfer"
)

func runMigrate(ctx context.Context, e *env, args []string) error {
	var c common
	fs := e.flags("migrate", &c)
	if err := e.parse(fs, args); err != nil {
		return err
	}
	log, err := c.logger(e.stderr)
	if err != nil {
		return err
	}
	pool, err := connect.Postgres(ctx, c.databaseURL, connect.PostgresOptions{AppName: "outbox-migrate", MaxConns: 2})
	if err != nil {
		return err
	}
	defer pool.Close()
	res, err := migrate.Up(ctx, pool)
	if err != nil {
		return err
	}
	for _, m := range res.Applied {
		log.Info("applied migration", "version", m.Version, "name", m.Name)
	}
	cc := pool.Config().ConnConfig
	fmt.Fprintf(e.stdout, "database %s on %s:%d: schema at version %d (%d applied now)\n",
		cc.Database, cc.Host, cc.Port, res.Current, len(res.Applied))
	if cc.Database == "postgres" || cc.Database == "template1" {
		log.Warn("migrated the maintenance database "+cc.Database+"; for your service's own database, set DATABASE_URL (or --database-url) to it",
			slog.String("database", cc.Database))
	}
	return nil
}

// requireSchema fails with a clear message when migrations have not run.
// openOutbox connects to the outbox database and checks that it is
// migrated; the caller closes the pool.
func openOutbox(ctx context.Context, databaseURL string, opt connect.PostgresOptions) (*pgxpool.Pool, error) {
	pool, err := connect.Postgres(ctx, databaseURL, opt)
	if err != nil {
		return nil, err
	}
	if err := requireSchema(ctx, pool); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

func requireSchema(ctx context.Context, pool *pgxpool.Pool) error {
	var ok bool
	err := pool.QueryRow(ctx, "SELECT to_regclass('outbox_messages') IS NOT NULL AND to_regclass('transfers') IS NOT NULL").Scan(&ok)
	if err != nil {
		return fmt.Errorf("check schema: %w", err)
	}
	if !ok {
		return errors.New("tables outbox_messages/transfers not found: run 'outbox migrate' first")
	}
	return nil
}

func runRelay(ctx context.Context, e *env, args []string) error {
	var c common
	var cfg relay.Config
	fs := e.flags("relay", &c)
	fs.StringVar(&cfg.Name, "name", "", "relay name, recorded in claimed_by (default hostname-pid)")
	fs.IntVar(&cfg.BatchSize, "batch", relay.DefaultBatchSize, "rows per claim and per pipelined publish")
	fs.StringVar(&cfg.Ownership, "ownership", envOr(e.getenv, "OUTBOX_RELAY_OWNERSHIP", relay.OwnRows),
		"how relays divide the outbox: rows (claim each row) or partitions (lease slots of partition keys; every relay of a database must use the same) (env OUTBOX_RELAY_OWNERSHIP)")
	fs.DurationVar(&cfg.Lease, "lease", relay.DefaultLease, "claim lease, and partition lease with --ownership partitions; expired claims are returned to pending")
	fs.DurationVar(&cfg.PollInterval, "poll", relay.DefaultPollInterval, "fallback poll interval (NOTIFY wakes the relay sooner)")
	busyPace := fs.Duration("busy-pace", relay.DefaultBusyPace, "while draining a steady stream of commits, pause this long after a small batch so commits gather (0 = never)")
	fs.DurationVar(&cfg.PublishTimeout, "publish-timeout", 0, "timeout of one pipelined publish (default min(5s, lease/2))")
	fs.IntVar(&cfg.MaxAttempts, "max-attempts", relay.DefaultMaxAttempts, "failed attempts after which an event is dead")
	fs.StringVar(&cfg.StreamPrefix, "stream-prefix", relay.DefaultStreamPrefix, "stream key prefix; the key is <prefix><aggregate_type>")
	fs.StringVar(&cfg.Stream, "stream", "", "publish every event to this one stream instead")
	fs.Int64Var(&cfg.StreamMaxLen, "stream-maxlen", 0, "cap each stream near this many entries, never trimming what a consumer group still needs (0 = no cap)")
	fs.DurationVar(&cfg.StreamRetention, "stream-retention", relay.DefaultStreamRetention, "trim entries older than this that every consumer group has acknowledged, never what a group still needs (0 = keep every entry; with --stream-maxlen alone, no age cap)")
	minReplicas := minReplicasFlag(e, fs, "mark an event published only once this many Redis replicas have its entry (WAIT); unconfirmed entries are retried without spending an attempt")
	partitions := partitionsFlag(e, fs, "split each stream into this many partition streams, by partition key (the sender account for TEDs)")
	fs.DurationVar(&cfg.ReplicaTimeout, "replica-timeout", 0, "longest wait for --min-replicas per publish (default min(1s, publish timeout/2))")
	metricsAddr := fs.String("metrics-addr", "", "serve /metrics, /healthz and /readyz on this address, e.g. :9464 (off when empty)")
	listenURL := fs.String("listen-database-url", e.getenv("LISTEN_DATABASE_URL"),
		"PostgreSQL URL of the LISTEN connection, when --database-url goes through a pooler in transaction mode: a direct or session-pooled connection (env LISTEN_DATABASE_URL; default --database-url)")
	if err := e.parse(fs, args); err != nil {
		return err
	}
	log, err := c.logger(e.stderr)
	if err != nil {
		return err
	}
	if *listenURL != "" {
		if cfg.ListenConfig, err = connect.PostgresConfig(*listenURL, "outbox-relay-listen"); err != nil {
			return usageError{err.Error()}
		}
	}
	if cfg.BatchSize <= 0 || cfg.Lease <= 0 || cfg.PollInterval <= 0 || cfg.MaxAttempts <= 0 || cfg.PublishTimeout < 0 || *busyPace < 0 {
		return usagef("--batch, --lease, --poll and --max-attempts must be positive, --publish-timeout and --busy-pace not negative")
	}
	if cfg.MinReplicas, err = minReplicas(); err != nil {
		return err
	}
	if cfg.Partitions, err = partitions(); err != nil {
		return err
	}
	cfg.BusyPace = *busyPace
	if cfg.BusyPace == 0 {
		cfg.BusyPace = -1 // never
	}
	switch {
	case cfg.StreamRetention < 0 || cfg.StreamMaxLen < 0:
		return usagef("--stream-retention and --stream-maxlen must not be negative")
	case cfg.StreamRetention == 0, cfg.StreamMaxLen > 0 && !isSet(fs, "stream-retention"):
		cfg.StreamRetention = -1 // no age cap (relay.Config: negative)
	}
	cfg.Logger = log
	if err := cfg.Validate(); err != nil {
		return usageError{err.Error()}
	}

	pool, err := openOutbox(ctx, c.databaseURL, connect.PostgresOptions{AppName: "outbox-relay", MaxConns: 4})
	if err != nil {
		return err
	}
	defer connect.ClosePool(pool, 3*time.Second)
	rdb, err := c.redis(ctx, connect.RedisOptions{ClientName: "outbox-relay", NoRetries: true})
	if err != nil {
		return err
	}
	defer rdb.Close()
	for _, w := range relay.CheckRedisDurability(ctx, rdb) {
		log.Warn(w)
	}
	stopTracing, err := tracing.Setup(ctx, "outbox-relay", log)
	if err != nil {
		return err
	}
	defer stopTracing(context.WithoutCancel(ctx))
	reg := metrics.NewRegistry()
	if *metricsAddr != "" {
		cfg.Metrics = relay.NewMetrics(reg)
		reg.MustRegister(relay.NewOutboxCollector(pool))
	}
	r, err := relay.New(pool, rdb, cfg)
	if err != nil {
		return usageError{err.Error()}
	}
	if *metricsAddr != "" {
		addr, err := metrics.Serve(ctx, *metricsAddr, reg, r.Ready, log)
		if err != nil {
			return err
		}
		log.Info("serving metrics", "addr", addr)
	}
	return r.Run(ctx)
}

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
	usageLine(fs, `outbox fraud [flags]        run the anti-fraud consumer
       outbox fraud report [flags] anti-fraud totals (see 'outbox fraud report -h')
       outbox fraud dlq <list|retry> [flags]
                                   the consumer's dead letters (see 'outbox fraud dlq -h')`)
	fs.StringVar(&cfg.Consumer, "consumer", "", "consumer name, stable across restarts (default hostname)")
	fs.IntVar(&cfg.BatchSize, "batch", fraud.DefaultBatchSize, "entries per read")
	fs.DurationVar(&cfg.Block, "block", fraud.DefaultBlock, "longest blocking read (bounds shutdown time)")
	fs.DurationVar(&cfg.ClaimInterval, "claim-interval", fraud.DefaultClaimInterval, "how often to claim entries of dead consumers")
	fs.DurationVar(&cfg.ClaimMinIdle, "claim-min-idle", fraud.DefaultClaimMinIdle, "idle time after which an entry is claimed")
	fs.IntVar(&cfg.MaxDeliveries, "max-deliveries", fraud.DefaultMaxDeliveries, "deliveries before an unprocessable entry is dead-lettered")
	fs.DurationVar(&cfg.DedupeTTL, "dedupe-ttl", fraud.DefaultDedupeTTL, "how long processed event ids are remembered")
	fs.Int64Var(&cfg.AmountLimitCents, "amount-limit", fraud.DefaultAmountLimitCents, "review a TED above this amount (cents)")
	fs.Int64Var(&cfg.WindowLimitCents, "window-limit", fraud.DefaultWindowLimitCents, "review when a sender's total over the window passes this (cents)")
	fs.DurationVar(&cfg.Window, "window", fraud.DefaultWindow, "velocity window")
	fs.DurationVar(&cfg.Retention, "retention", fraud.DefaultRetention, "how long verdicts, daily sender totals and review alerts are kept (after the end of the settlement day); bounds Redis memory")
	minReplicas := minReplicasFlag(e, fs, "acknowledge an entry only once this many Redis replicas have its effect (WAIT); unconfirmed entries stay pending and are retried")
	partitions := partitionsFlag(e, fs, "the partitions of the stream, as the relay splits it; the group's consumers divide them among themselves")
	fs.DurationVar(&cfg.PartitionLease, "partition-lease", fraud.DefaultPartitionLease, "how long this consumer's hold on a partition lasts unrenewed: a dead consumer's partitions move within it")
	fs.IntVar(&cfg.AuditLen, "audit-len", 0, "keep a stream per partition of the effects in the order applied (<prefix>audit), about this many entries each; 0 keeps none")
	fs.DurationVar(&cfg.ReplicaTimeout, "replica-timeout", time.Second, "longest wait for --min-replicas per batch")
	metricsAddr := fs.String("metrics-addr", "", "serve /metrics, /healthz and /readyz on this address, e.g. :9465 (off when empty)")
	if err := e.parse(fs, args); err != nil {
		return err
	}
	log, err := c.logger(e.stderr)
	if err != nil {
		return err
	}
	if cfg.MinReplicas, err = minReplicas(); err != nil {
		return err
	}
	if cfg.Partitions, err = partitions(); err != nil {
		return err
	}
	if cfg.BatchSize <= 0 || cfg.Block <= 0 || cfg.ClaimInterval <= 0 || cfg.ClaimMinIdle <= 0 ||
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
	// A worker per owned partition blocks a connection in XREADGROUP.
	pool := max(10*runtime.GOMAXPROCS(0), cfg.Partitions+8)
	rdb, err := c.redis(ctx, connect.RedisOptions{ClientName: "outbox-fraud-" + name, PoolSize: pool})
	if err != nil {
		return err
	}
	defer rdb.Close()
	stopTracing, err := tracing.Setup(ctx, "outbox-fraud", log)
	if err != nil {
		return err
	}
	defer stopTracing(context.WithoutCancel(ctx))
	reg := metrics.NewRegistry()
	if *metricsAddr != "" {
		cfg.Metrics = fraud.NewMetrics(reg)
		reg.MustRegister(fraud.NewGroupCollector(rdb, cfg.Stream, cfg.Group).WithPartitions(cfg.Partitions))
	}
	cons, err := fraud.New(rdb, cfg)
	if err != nil {
		return usageError{err.Error()}
	}
	if *metricsAddr != "" {
		addr, err := metrics.Serve(ctx, *metricsAddr, reg, cons.Ready, log)
		if err != nil {
			return err
		}
		log.Info("serving metrics", "addr", addr)
	}
	return cons.Run(ctx)
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

// Status is what 'outbox status --json' prints. During an outage it still
// shows what the reachable server says: the other side's figures are zero and
// its error is in postgres_error or redis_error (and the command exits 1).
type Status struct {
	Pending              int64   `json:"pending"`
	Publishing           int64   `json:"publishing"`
	Published            int64   `json:"published"`
	Dead                 int64   `json:"dead"`
	OldestPendingSeconds float64 `json:"oldest_pending_seconds"`
	ListeningRelays      int64   `json:"listening_relays"`
	Stream               string  `json:"stream"`
	StreamLength         int64   `json:"stream_length"`
	Group                string  `json:"group"`
	GroupPending         int64   `json:"group_pending"`
	GroupLag             int64   `json:"group_lag"`
	GroupExists          bool    `json:"group_exists"`
	DeadLetterStream     string  `json:"dead_letter_stream"`
	DeadLettered         int64   `json:"dead_lettered"`
	// With several partitions, the stream, group and dead-letter figures
	// above are sums over the partitions, and ByPartition has each one.
	Partitions  int               `json:"partitions"`
	ByPartition []PartitionStatus `json:"by_partition"`
	// RelaySlots: with relays that own partitions (--ownership
	// partitions), how many of the partition slots each relay holds;
	// RelaySlotsFree: how many nobody holds (empty and 0 with row claims:
	// no slot is ever held).
	RelaySlots     map[string]int `json:"relay_slots,omitempty"`
	RelaySlotsFree int            `json:"relay_slots_free"`
	// PostgresError and RedisError say why a side could not be read (empty:
	// it was read).
	PostgresError string `json:"postgres_error,omitempty"`
	RedisError    string `json:"redis_error,omitempty"`
}

// PartitionStatus is one partition's stream and group, and which consumer
// of the group holds it.
type PartitionStatus struct {
	Partition    int    `json:"partition"`
	Stream       string `json:"stream"`
	StreamLength int64  `json:"stream_length"`
	GroupPending int64  `json:"group_pending"`
	GroupLag     int64  `json:"group_lag"`
	GroupExists  bool   `json:"group_exists"`
	Owner        string `json:"owner"` // the consumer holding its lease; empty: none
	DeadLettered int64  `json:"dead_lettered"`
}

func runStatus(ctx context.Context, e *env, args []string) error {
	var c common
	fs := e.flags("status", &c)
	stream := fs.String("stream", fraud.DefaultStream, "stream to report on")
	group := fs.String("group", fraud.DefaultGroup, "consumer group to report on")
	keyPrefix := fs.String("key-prefix", fraud.DefaultKeyPrefix, "anti-fraud key prefix (for its dead-letter stream)")
	partitions := partitionsFlag(e, fs, "the partitions of the stream (figures are summed over them, and shown for each)")
	asJSON := fs.Bool("json", false, "print JSON")
	if err := e.parse(fs, args); err != nil {
		return err
	}
	nParts, err := partitions()
	if err != nil {
		return err
	}
	if err := (fraud.Config{Stream: *stream, Group: *group, KeyPrefix: *keyPrefix, Consumer: "status"}).Validate(); err != nil {
		return usagef("%v", err)
	}
	if _, err := c.logger(e.stderr); err != nil {
		return err
	}
	st := Status{Stream: *stream, Group: *group, DeadLetterStream: fraud.Keys{Prefix: *keyPrefix}.DeadLetters(), Partitions: nParts}
	keys := fraud.Keys{Prefix: *keyPrefix, Partitions: nParts}
	// Each side is read on its own: an operator needs the PostgreSQL backlog
	// most when Redis is down, and the stream's state when PostgreSQL is.
	pgErr := func() error {
		pool, err := openOutbox(ctx, c.databaseURL, connect.PostgresOptions{AppName: "outbox-status", MaxConns: 2})
		if err != nil {
			return err
		}
		defer pool.Close()
		return readOutboxStatus(ctx, pool, &st)
	}()
	redisErr := func() error {
		rdb, err := c.redis(ctx, connect.RedisOptions{ClientName: "outbox-status"})
		if err != nil {
			return err
		}
		defer rdb.Close()
		return readStreamStatus(ctx, rdb, keys, &st)
	}()
	if pgErr != nil {
		st.PostgresError = connect.RedactSecrets(oneLine(pgErr))
	}
	if redisErr != nil {
		st.RedisError = connect.RedactSecrets(oneLine(redisErr))
	}
	if *asJSON {
		if err := json.NewEncoder(e.stdout).Encode(st); err != nil {
			return err
		}
	} else {
		printStatus(e.stdout, st)
	}
	return errors.Join(pgErr, redisErr)
}

func printStatus(w io.Writer, st Status) {
	if st.PostgresError != "" {
		fmt.Fprintf(w, "outbox   PostgreSQL unreachable: %s\n", st.PostgresError)
	} else {
		fmt.Fprintf(w, "outbox   pending %d  publishing %d  published %d  dead %d  oldest pending %.1fs  relays listening %d\n",
			st.Pending, st.Publishing, st.Published, st.Dead, st.OldestPendingSeconds, st.ListeningRelays)
		if len(st.RelaySlots) > 0 {
			var held []string
			for _, owner := range slices.Sorted(maps.Keys(st.RelaySlots)) {
				held = append(held, fmt.Sprintf("%s %d", owner, st.RelaySlots[owner]))
			}
			fmt.Fprintf(w, "relays   partition slots held: %s  free %d\n", strings.Join(held, ", "), st.RelaySlotsFree)
		}
	}
	if st.RedisError != "" {
		fmt.Fprintf(w, "stream   %s  Redis unreachable: %s\n", st.Stream, st.RedisError)
		return
	}
	fmt.Fprintf(w, "stream   %s  length %d\n", st.Stream, st.StreamLength)
	if st.GroupExists {
		fmt.Fprintf(w, "group    %s  pending %d  lag %d\n", st.Group, st.GroupPending, st.GroupLag)
	} else {
		fmt.Fprintf(w, "group    %s  not created yet\n", st.Group)
	}
	fmt.Fprintf(w, "dlq      %s  entries %d\n", st.DeadLetterStream, st.DeadLettered)
	if st.Partitions > 1 {
		for _, p := range st.ByPartition {
			owner := p.Owner
			if owner == "" {
				owner = "(none)"
			}
			fmt.Fprintf(w, "  p%-4d  %s  length %d  pending %d  lag %d  dlq %d  owner %s\n",
				p.Partition, p.Stream, p.StreamLength, p.GroupPending, p.GroupLag, p.DeadLettered, owner)
		}
	} else if len(st.ByPartition) == 1 && st.ByPartition[0].Owner != "" {
		fmt.Fprintf(w, "owner    %s\n", st.ByPartition[0].Owner)
	}
}

func readOutboxStatus(ctx context.Context, pool *pgxpool.Pool, st *Status) error {
	err := pool.QueryRow(ctx, outboxsql.Query("status")).
		Scan(&st.Pending, &st.Publishing, &st.Published, &st.Dead, &st.OldestPendingSeconds)
	if err != nil {
		return fmt.Errorf("read outbox status: %w", err)
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
		WHERE datname = current_database() AND application_name LIKE 'outbox-relay%-listen'`).Scan(&st.ListeningRelays); err != nil {
		return fmt.Errorf("count listening relays: %w", err)
	}
	rows, err := pool.Query(ctx, outboxsql.Query("status_relay_slots"))
	if err != nil {
		return fmt.Errorf("read relay partition slots: %w", err)
	}
	var owner *string
	var slots int
	_, err = pgx.ForEachRow(rows, []any{&owner, &slots}, func() error {
		if owner == nil {
			st.RelaySlotsFree += slots
			return nil
		}
		if st.RelaySlots == nil {
			st.RelaySlots = map[string]int{}
		}
		st.RelaySlots[*owner] = slots
		return nil
	})
	if err != nil {
		return fmt.Errorf("read relay partition slots: %w", err)
	}
	return nil
}

func readStreamStatus(ctx context.Context, rdb redis.Cmdable, keys fraud.Keys, st *Status) error {
	st.GroupExists = true
	for p, k := range keys.Each() {
		ps := PartitionStatus{Partition: p, Stream: partition.Stream(st.Stream, p, st.Partitions)}
		if err := readPartitionStatus(ctx, rdb, k, st.Group, &ps); err != nil {
			return err
		}
		st.ByPartition = append(st.ByPartition, ps)
		st.StreamLength += ps.StreamLength
		st.GroupPending += ps.GroupPending
		st.GroupLag += ps.GroupLag
		st.GroupExists = st.GroupExists && ps.GroupExists
		st.DeadLettered += ps.DeadLettered
	}
	return nil
}

func readPartitionStatus(ctx context.Context, rdb redis.Cmdable, keys fraud.Keys, group string, ps *PartitionStatus) error {
	var err error
	if ps.DeadLettered, err = rdb.XLen(ctx, keys.DeadLetters()).Result(); err != nil {
		return fmt.Errorf("read dead-letter stream length: %w", err)
	}
	if ps.StreamLength, err = rdb.XLen(ctx, ps.Stream).Result(); err != nil {
		return fmt.Errorf("read stream length: %w", err)
	}
	groups, err := rdb.XInfoGroups(ctx, ps.Stream).Result()
	if err != nil && !isNoSuchKey(err) {
		return fmt.Errorf("read consumer groups: %w", err)
	}
	for _, g := range groups {
		if g.Name == group {
			ps.GroupExists, ps.GroupPending, ps.GroupLag = true, g.Pending, g.Lag
		}
	}
	lease, err := rdb.Get(ctx, keys.Lease(group)).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("read the partition's lease: %w", err)
	}
	if _, holder, ok := strings.Cut(lease, "|"); ok {
		ps.Owner, _, _ = strings.Cut(holder, "|")
	}
	return nil
}

func isNoSuchKey(err error) bool {
	return err != nil && (redis.HasErrorPrefix(err, "no such key") || errors.Is(err, redis.Nil))
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
