// Package consumer reads the events a relay publishes to a Redis Stream (or
// another broker's: a Source, package consumer/source), as a member of a
// consumer group, and applies each one's effect exactly once through a
// Handler: the caller says what an event does; the package does the rest.
// It divides the stream's partitions among the group's consumers, each
// applied by one consumer at a time in stream order, fenced (ownership.go);
// a partition's new owner first applies what an earlier owner left
// unacknowledged, then new events; failures are retried with backoff while
// the other keys go on; events that can never be applied move to a
// dead-letter stream; metrics and traces are exported. Run stops
// gracefully.
//
// Delivery is at least once (a relay can publish an event twice, a consumer
// can die before XACK), so an effect must be recorded with a dedupe record
// of its event id, atomically, before the entry is acknowledged. Two ways to
// do so come with the package: Inbox (the effect in a transaction on the
// consumer's own PostgreSQL, with the event id inserted in an inbox table)
// and RunScripts (Redis Lua scripts that check and set a marker with the
// effect: anti-fraud, package fraud, is such a consumer).
//
// The code, one concept per file: consumer.go (the Consumer, Run),
// ownership.go and lease.lua (the group's coordination in Redis, whatever
// the source: partition leases and their fences, one worker per partition),
// work.go (the worker's loop over its partition's source, the same for
// every source; dead letters), streams.go (Redis Streams as the source: the
// takeover of pending entries, retries, claims of idle entries, entries an
// earlier owner read late), handle.go (one batch: decode, handle, sort the
// outcomes), order.go (per-key order across failures), message.go
// (Message, Batch, Handler), script.go (the Redis Lua path), deadletter.lua,
// name.go and presence.go (one process per consumer name, and its
// liveness), keys.go, config.go and metrics.go. NATS JetStream's source is
// package consumer/natssource; the PostgreSQL inbox is package
// consumer/inbox.
package consumer

import (
	"context"
	_ "embed"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer/source"
	"github.com/tedbank/outbox/internal/redischeck"
	"github.com/tedbank/outbox/internal/testsignal"
	"github.com/tedbank/outbox/internal/tracing"
)

var tracer = tracing.Tracer("github.com/tedbank/outbox/consumer")

// Consumer is one member of a consumer group.
type Consumer struct {
	cfg     Config
	rdb     redis.Cmdable
	src     source.Source // where messages come from: Redis Streams (streams.go) unless NewWithSource says otherwise
	handler Handler
	keys    Keys    // the keys of the group as a whole (names, members)
	parts   []part  // the stream's partitions
	gates   []*gate // each partition's per-key order, for the single steps (Run's workers have their own)
	log     *slog.Logger
	stats   counters
	// streamAgeChecked: the source's retention was found covered by the
	// handler's dedupe records (checkStreamAge).
	streamAgeChecked atomic.Bool
	group            *coordination // membership, leases, names: who applies what (ownership.go)
	// reading: a worker is about to read its partition, whose number it
	// sends (tests only: a test waits on it for a consumer in its read).
	reading testsignal.Signal[int]
	// The fail points of this kind of consumer (Config.Name).
	afterRead, afterEffect string
	outcomeAttr            string // the span attribute of a message's outcome
}

type counters struct {
	processed, duplicates, deadLettered, failed, lost atomic.Int64
}

// Stats counts what a consumer did since it started.
type Stats struct {
	Processed    int64 // effects applied
	Duplicates   int64 // deliveries skipped as already applied
	DeadLettered int64 // entries moved to the dead-letter stream
	Failed       int64 // deliveries that failed and stay pending
	Lost         int64 // pending entries whose payload was trimmed away
}

// New returns a consumer reading with rdb and applying with h. It checks
// cfg but does not connect.
func New(rdb redis.Cmdable, h Handler, cfg Config) (*Consumer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	if _, cluster := rdb.(*redis.ClusterClient); cluster && cfg.Partitions < 2 {
		// A partition's stream and state share a hash slot only under the
		// partitions' hash tags; one partition keeps the plain key names.
		return nil, fmt.Errorf("%w: on a Redis Cluster the stream must have at least 2 partitions (--partitions), so that each partition's keys share a hash slot", ErrConfig)
	}
	if h == nil {
		return nil, fmt.Errorf("%w: no handler", ErrConfig)
	}
	if d, ok := h.(Deduper); ok {
		if err := cfg.CheckDedupeWindow(d.DedupeTTL()); err != nil {
			return nil, err
		}
	}
	ps := parts(cfg)
	gates := make([]*gate, len(ps))
	for i := range gates {
		gates[i] = newGate()
	}
	c := &Consumer{
		cfg:         cfg,
		gates:       gates,
		rdb:         rdb,
		handler:     h,
		keys:        Keys{Prefix: cfg.KeyPrefix},
		parts:       ps,
		log:         cfg.Logger.With(slog.String("consumer", cfg.Consumer), slog.String("group", cfg.Group)),
		afterRead:   cfg.Name + ".after-read",
		afterEffect: cfg.Name + ".after-effect",
		outcomeAttr: cfg.Name + ".outcome",
	}
	c.src = newStreams(rdb, cfg, c.log)
	c.group = &coordination{rdb: rdb, cfg: cfg, keys: c.keys, parts: ps, log: c.log, token: processToken(rdb)}
	return c, nil
}

// readsStreams reports whether the consumer reads Redis Streams (New), not
// another source (NewWithSource).
func (c *Consumer) readsStreams() bool {
	_, ok := c.src.(*streams)
	return ok
}

// processToken is a new process's token: with presencePrefix when it keeps
// a presence connection (presence.go).
func processToken(rdb redis.Cmdable) string {
	if presenceCapable(rdb) {
		return presencePrefix + uuid.NewString()
	}
	return uuid.NewString()
}

// Ready reports why the consumer cannot do its work right now, or nil: Redis
// does not answer, or the handler says why (a handler with a method
// Ready(ctx) error, as the inbox's, which pings its database).
func (c *Consumer) Ready(ctx context.Context) error {
	if err := c.rdb.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("redis: %w", err)
	}
	if !c.readsStreams() { // Redis Streams' answered the ping above
		if err := c.src.Ping(ctx); err != nil {
			return fmt.Errorf("%s: %w", c.src.System(), err)
		}
	}
	if r, ok := c.handler.(interface{ Ready(context.Context) error }); ok {
		return r.Ready(ctx)
	}
	return nil
}

// Config returns the consumer's effective configuration.
func (c *Consumer) Config() Config { return c.cfg }

// Stats returns a snapshot of the consumer's counters.
func (c *Consumer) Stats() Stats {
	return Stats{
		Processed: c.stats.processed.Load(), Duplicates: c.stats.duplicates.Load(),
		DeadLettered: c.stats.deadLettered.Load(), Failed: c.stats.failed.Load(), Lost: c.stats.lost.Load(),
	}
}

// EnsureGroup creates the consumer group (and the stream) of every partition
// if missing, on a source that has groups to create (Redis Streams; another
// source opens a partition when it is taken over). A group starts at "0",
// not "$": after a stream is lost and recreated, the relay may already have
// appended entries that must not be skipped.
func (c *Consumer) EnsureGroup(ctx context.Context) error {
	g, ok := c.src.(interface {
		CreateGroup(ctx context.Context, group, subject string) error
	})
	if !ok {
		return nil
	}
	for _, pt := range c.parts {
		if err := g.CreateGroup(ctx, c.cfg.Group, pt.stream); err != nil {
			return err
		}
	}
	return nil
}

// Run consumes until ctx is cancelled and returns nil then, once the batches
// in flight are done (a read waiting for new entries ends within a quarter
// second: streams.go, readSlice). The consumers of the group divide the partitions
// among themselves (ownership.go); for each partition it owns, the consumer
// first takes over every entry still pending in the group (delivered before
// a crash or a rebalance, never acknowledged) and applies them in stream
// order, then reads new ones, and every ClaimInterval re-delivers its own
// entries idle for ClaimMinIdle (ones that keep failing).
func (c *Consumer) Run(ctx context.Context) error {
	if err := c.checkEviction(ctx); err != nil {
		return err
	}
	if err := c.EnsureGroup(ctx); err != nil {
		return err
	}
	if err := c.checkStreamAge(ctx); err != nil {
		return err // (a stream the relay has not created yet is checked when a partition is taken over)
	}
	if err := c.group.ensureNameFree(ctx); err != nil {
		return err
	}
	defer c.group.releaseName()
	c.log.Info("consumer starting", slog.String("stream", c.cfg.Stream), slog.Int("partitions", c.cfg.Partitions))
	if m, ok := c.handler.(Maintainer); ok {
		// Its own context: Run also ends without ctx cancelled (a name
		// taken while this consumer stalled), and must not wait for it.
		mctx, stop := context.WithCancel(ctx)
		var wg sync.WaitGroup
		wg.Go(func() { m.Maintain(mctx) })
		defer wg.Wait()
		defer stop()
	}
	err := c.own(ctx)
	c.log.Info("consumer stopped", slog.Int64("processed", c.stats.processed.Load()))
	return err
}

// checkEviction refuses a Redis that evicts keys (ErrEvictingRedis) unless
// Config.AllowEvictingRedis says otherwise; a Redis it cannot read INFO
// from is not refused (the first read says why, if it is down).
func (c *Consumer) checkEviction(ctx context.Context) error {
	nodes, err := redischeck.Inspect(ctx, c.rdb)
	if err != nil { // refused on what it could read, below
		c.log.Warn("could not read the Redis eviction policy of every node", slog.Any("error", err))
	}
	if addrs := redischeck.NoAOF(nodes); len(addrs) > 0 && c.readsStreams() {
		c.log.Warn("Redis runs without appendonly: a Redis restart loses the stream's entries and the group's "+
			"pending entries (set appendonly yes)", slog.Any("nodes", addrs))
	}
	if err := redischeck.Refuse(nodes, "AllowEvictingRedis (outbox: --allow-evicting-redis)"); err != nil {
		if !c.cfg.AllowEvictingRedis {
			return err
		}
		c.log.Warn("starting on an evicting Redis, as allowed", slog.Any("warning", err))
	}
	return nil
}
