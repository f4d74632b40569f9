// Package consumer reads the events a relay publishes to a Redis Stream (or
// a Source: package consumer/source), as a member of a consumer group, and applies each one's effect exactly once
// through a Handler: the caller says what an event does; the package does the
// rest. It reads the consumer's own pending entries first, then new ones;
// claims the entries of consumers that died; divides the stream's partitions
// among the group's consumers, each applied by one consumer at a time in
// stream order, fenced (ownership.go); retries failures with backoff; moves
// entries that can never be applied to a dead-letter stream; and exports
// metrics and traces. Run stops gracefully.
//
// Delivery is at least once (a relay can publish an event twice, a consumer
// can die before XACK), so an effect must be recorded with a dedupe record
// of its event id, atomically, before the entry is acknowledged. Two ways to
// do so come with the package: Inbox (the effect in a transaction on the
// consumer's own PostgreSQL, with the event id inserted in an inbox table)
// and RunScripts (Redis Lua scripts that check and set a marker with the
// effect: anti-fraud, package fraud, is such a consumer).
//
// The code, one concept per file: consumer.go (the Consumer, Run, one
// worker per partition), message.go (Message, Batch, Handler), read.go
// (what to read from Redis Streams: own pending entries, new entries, idle
// entries of dead consumers, entries a previous partition owner left),
// fromsource.go (reading a Source instead: NATS JetStream in natssource), handle.go (one batch:
// decode, handle, acknowledge), script.go (the Redis Lua path),
// deadletter.go and deadletter.lua, ownership.go and lease.lua (partition
// leases), name.go (one process per consumer name), keys.go, config.go and
// metrics.go. The PostgreSQL inbox is package consumer/inbox.
package consumer

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer/source"
	"github.com/tedbank/outbox/internal/redischeck"
	"github.com/tedbank/outbox/internal/retry"
	"github.com/tedbank/outbox/internal/tracing"
)

var tracer = tracing.Tracer("github.com/tedbank/outbox/consumer")

// Consumer is one member of a consumer group.
type Consumer struct {
	cfg     Config
	rdb     redis.Cmdable
	src     source.Source // set: messages come from it (fromsource.go), not from Redis Streams
	handler Handler
	keys    Keys    // the keys of the group as a whole (names, members)
	parts   []part  // the stream's partitions
	gates   []*gate // each partition's per-key order, for the single steps (Run's workers have their own)
	log     *slog.Logger
	stats   counters
	// streamAgeChecked: the source's retention was found covered by the
	// handler's dedupe records (checkStreamAge).
	streamAgeChecked atomic.Bool
	// token identifies this process in the consumer name's lease.
	token        string
	leaseRenewed time.Time
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
	return &Consumer{
		cfg:         cfg,
		gates:       gates,
		rdb:         rdb,
		handler:     h,
		keys:        Keys{Prefix: cfg.KeyPrefix},
		parts:       ps,
		token:       processToken(rdb),
		log:         cfg.Logger.With(slog.String("consumer", cfg.Consumer), slog.String("group", cfg.Group)),
		afterRead:   cfg.Name + ".after-read",
		afterEffect: cfg.Name + ".after-effect",
		outcomeAttr: cfg.Name + ".outcome",
	}, nil
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
	if c.src != nil {
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
// if missing. It starts at "0", not "$": after a stream is lost and
// recreated, the relay may already have appended entries that must not be
// skipped.
func (c *Consumer) EnsureGroup(ctx context.Context) error {
	if c.src != nil {
		return nil // a partition is opened on the source when it is taken over
	}
	for _, pt := range c.parts {
		if err := c.ensureGroup(ctx, pt); err != nil {
			return err
		}
	}
	return nil
}

func (c *Consumer) ensureGroup(ctx context.Context, pt part) error {
	err := c.rdb.XGroupCreateMkStream(ctx, pt.stream, c.cfg.Group, "0").Err()
	if err != nil && !redis.HasErrorPrefix(err, "BUSYGROUP") {
		return fmt.Errorf("create consumer group %s on %s: %w", c.cfg.Group, pt.stream, err)
	}
	return nil
}

// Run consumes until ctx is cancelled and returns nil then; shutdown takes at
// most about Config.Block. The consumers of the group divide the partitions
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
	if err := c.ensureNameFree(ctx); err != nil {
		return err
	}
	defer c.releaseName()
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

// feed is a partition as one of its workers applies it: fence is the lease
// value the effects must find (empty: applied without ownership, by the
// single steps ReadNew, ProcessPending and ClaimIdle); gate keeps each key's
// order across reads (order.go; nil for a Source, which reads a partition
// again from what is unacknowledged after any failure).
type feed struct {
	part
	fence string
	gate  *gate
}

// work applies partition pt while this consumer holds its lease with value
// fence, until ctx is cancelled or the lease turns out lost.
func (c *Consumer) work(ctx context.Context, pt part, fence string) {
	if c.src != nil {
		c.workSource(ctx, pt, fence)
		return
	}
	f := feed{part: pt, fence: fence, gate: newGate()}
	log := c.log.With(slog.Int("partition", pt.n))
	takenOver := false
	needPending := false
	var pendingFailures int
	var retryPendingAt time.Time
	lastClaim := time.Now()
	failures := 0
	count := c.cfg.BatchSize // new entries per read (nextCount)
	var ahead *readAhead     // the next read of new entries, sent under a backlog
	defer func() {
		if ahead != nil {
			<-ahead.done
		}
	}()
	for ctx.Err() == nil {
		var err error
		pendingDue := needPending && !time.Now().Before(retryPendingAt)
		claimDue := time.Since(lastClaim) >= c.cfg.ClaimInterval
		switch {
		case ahead != nil:
			// What it read follows what was just processed: before
			// anything else; and it reads on only when nothing else is
			// due, so that a backlog does not put off the retries.
			var n int
			n, ahead, err = c.readNew(ctx, f, count, ahead, !pendingDue && !claimDue)
			count = c.nextCount(count, n)
		case !takenOver:
			// Every entry pending in the group, whoever it was delivered
			// to, is older than every entry not yet delivered: apply them
			// first, in stream order. (The consumer is created first, so
			// that XINFO CONSUMERS lists it before it has read anything.)
			if err = c.rdb.XGroupCreateConsumer(ctx, pt.stream, c.cfg.Group, c.cfg.Consumer).Err(); err != nil {
				break
			}
			// Effects that failed do not keep the partition in its
			// takeover: their entries are pending, in the gate, and
			// retried with the pending ones, while the other keys go on.
			if _, err = c.claim(ctx, f, 0); err == nil || effectFailedOnly(err) {
				takenOver = true
			}
		case pendingDue:
			// Entries of ours that failed transiently are still pending:
			// retry them, with backoff, but never instead of reading new
			// ones: one entry that keeps failing must not stop the rest.
			if err = c.processPending(ctx, f); err != nil {
				pendingFailures++
				d := retryDelay(pendingFailures)
				retryPendingAt = time.Now().Add(d)
				if !errors.Is(err, ErrFenced) && !redis.HasErrorPrefix(err, "NOGROUP") && ctx.Err() == nil {
					// The backoff paces these retries: read new
					// entries meanwhile (the gate holds back those
					// of the failing keys).
					log.Warn("pending entries failed again; retrying", slog.Any("error", err), slog.Duration("retry_in", d))
					err = nil
				}
			} else {
				// Entries held behind a failed one were read with it in
				// this pass; none should be left, but if one is, try
				// again soon, not in a tight loop.
				needPending, pendingFailures = !f.gate.empty(), 0
				retryPendingAt = time.Now().Add(retryDelay(1))
			}
		case claimDue:
			_, err = c.claim(ctx, f, c.cfg.ClaimMinIdle)
			lastClaim = time.Now()
		default:
			var n int
			n, ahead, err = c.readNew(ctx, f, count, nil, true)
			count = c.nextCount(count, n)
		}
		if !f.gate.empty() {
			// Entries wait behind a failed one of their key: they are
			// applied by the retry of the pending entries, in order.
			needPending = true
		}
		switch {
		case err == nil:
			failures = 0
		case ctx.Err() != nil:
		case errors.Is(err, ErrFenced):
			log.Error("partition lease lost while applying its events; stopping the partition", slog.Any("error", err))
			return
		case redis.HasErrorPrefix(err, "NOGROUP"):
			log.Warn("consumer group missing (stream deleted?); recreating it")
			if err := c.ensureGroup(ctx, pt); err != nil {
				log.Warn("recreating group failed", slog.Any("error", err))
				retry.Sleep(ctx, time.Second)
			}
		default:
			failures++
			d := retryDelay(failures)
			log.Warn("processing failed; retrying", slog.Any("error", err), slog.Duration("retry_in", d))
			retry.Sleep(ctx, d)
			needPending = true
		}
	}
}

// checkEviction refuses a Redis that evicts keys (ErrEvictingRedis) unless
// Config.AllowEvictingRedis says otherwise; a Redis it cannot read INFO
// from is not refused (the first read says why, if it is down).
func (c *Consumer) checkEviction(ctx context.Context) error {
	nodes, err := redischeck.Inspect(ctx, c.rdb)
	if err != nil { // refused on what it could read, below
		c.log.Warn("could not read the Redis eviction policy of every node", slog.Any("error", err))
	}
	if addrs := redischeck.NoAOF(nodes); len(addrs) > 0 && c.src == nil {
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
