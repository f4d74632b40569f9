// Package fraud is the anti-fraud service: a Redis Streams consumer group that
// reads transfer.settled events and applies a simple velocity rule to each.
//
// Delivery is at least once (a relay can publish an event twice, a consumer
// can die before XACK), so the effect of an event — its verdict, the sender's
// running totals, an alert for review verdicts — is applied together with a
// dedupe marker on the event id in one Lua script, and only then acknowledged.
// A crash anywhere leaves either no effect (the entry is redelivered and
// applied) or the effect and the marker (the redelivery is skipped).
package fraud

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/tedbank/outbox/internal/failpoint"
	"github.com/tedbank/outbox/internal/retry"
	"github.com/tedbank/outbox/internal/tracing"
	"github.com/tedbank/outbox/partition"
	"github.com/tedbank/outbox/relay/entry"
)

var (
	//go:embed effect.lua
	effectSrc string
	//go:embed deadletter.lua
	deadLetterSrc string

	effectScript     = redis.NewScript(effectSrc)
	deadLetterScript = redis.NewScript(deadLetterSrc)
)

// Outcome of one entry.
const (
	outcomeDuplicate = 0
	outcomeApprove   = 1
	outcomeReview    = 2
)

var tracer = tracing.Tracer("github.com/tedbank/outbox/fraud")

var outcomeNames = map[int]string{outcomeDuplicate: "duplicate", outcomeApprove: "approve", outcomeReview: "review"}

// Consumer is one member of the anti-fraud consumer group.
type Consumer struct {
	cfg   Config
	rdb   redis.Cmdable
	keys  Keys   // the keys of the group as a whole (names, members)
	parts []part // the stream's partitions
	log   *slog.Logger
	stats counters
	// token identifies this process in the consumer name's lease.
	token        string
	leaseRenewed time.Time
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

// New returns a consumer reading with rdb. It checks cfg but does not connect.
func New(rdb redis.Cmdable, cfg Config) (*Consumer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	if _, cluster := rdb.(*redis.ClusterClient); cluster && cfg.Partitions < 2 {
		// A partition's stream and state share a hash slot only under the
		// partitions' hash tags; one partition keeps the plain key names.
		return nil, fmt.Errorf("%w: on a Redis Cluster the stream must have at least 2 partitions (--partitions), so that each partition's keys share a hash slot", ErrConfig)
	}
	return &Consumer{
		cfg:   cfg,
		rdb:   rdb,
		keys:  Keys{Prefix: cfg.KeyPrefix},
		parts: parts(cfg),
		token: uuid.NewString(),
		log:   cfg.Logger.With(slog.String("consumer", cfg.Consumer), slog.String("group", cfg.Group)),
	}, nil
}

// Ready reports why the consumer cannot do its work right now, or nil.
func (c *Consumer) Ready(ctx context.Context) error {
	if err := c.rdb.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("redis: %w", err)
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
	if err := c.EnsureGroup(ctx); err != nil {
		return err
	}
	if err := c.ensureNameFree(ctx); err != nil {
		return err
	}
	defer c.releaseName()
	c.log.Info("consumer starting", slog.String("stream", c.cfg.Stream), slog.Int("partitions", c.cfg.Partitions))
	c.own(ctx)
	c.log.Info("consumer stopped", slog.Int64("processed", c.stats.processed.Load()))
	return nil
}

// feed is a partition as one of its workers applies it: fence is the lease
// value the effects must find (empty: applied without ownership, by the
// single steps ReadNew, ProcessPending and ClaimIdle).
type feed struct {
	part
	fence string
}

// work applies partition pt while this consumer holds its lease with value
// fence, until ctx is cancelled or the lease turns out lost.
func (c *Consumer) work(ctx context.Context, pt part, fence string) {
	f := feed{part: pt, fence: fence}
	log := c.log.With(slog.Int("partition", pt.n))
	takenOver := false
	needPending := false
	var pendingFailures int
	var retryPendingAt time.Time
	lastClaim := time.Now()
	failures := 0
	for ctx.Err() == nil {
		var err error
		switch {
		case !takenOver:
			// Every entry pending in the group, whoever it was delivered
			// to, is older than every entry not yet delivered: apply them
			// first, in stream order. (The consumer is created first, so
			// that XINFO CONSUMERS lists it before it has read anything.)
			if err = c.rdb.XGroupCreateConsumer(ctx, pt.stream, c.cfg.Group, c.cfg.Consumer).Err(); err != nil {
				break
			}
			if _, err = c.claim(ctx, f, 0); err == nil {
				takenOver = true
			}
		case needPending && !time.Now().Before(retryPendingAt):
			// Entries of ours that failed transiently are still pending:
			// retry them, with backoff, but never instead of reading new
			// ones: one entry that keeps failing must not stop the rest.
			if err = c.processPending(ctx, f); err != nil {
				pendingFailures++
				retryPendingAt = time.Now().Add(retryDelay(pendingFailures))
			} else {
				needPending, pendingFailures = false, 0
			}
		case time.Since(lastClaim) >= c.cfg.ClaimInterval:
			_, err = c.claim(ctx, f, c.cfg.ClaimMinIdle)
			lastClaim = time.Now()
		default:
			_, err = c.readNew(ctx, f)
		}
		switch {
		case err == nil:
			failures = 0
		case ctx.Err() != nil:
		case errors.Is(err, errFenced):
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

// ReadNew blocks up to Config.Block for new entries of every partition and
// processes them. Run is how to consume: ReadNew, ProcessPending and
// ClaimIdle are its single steps, without partition ownership, for tests and
// tools that drive a consumer by hand; with several partitions ReadNew reads
// them in one command, which a Redis Cluster refuses.
func (c *Consumer) ReadNew(ctx context.Context) (int, error) {
	streams := make([]string, 0, 2*len(c.parts))
	for _, pt := range c.parts {
		streams = append(streams, pt.stream)
	}
	for range c.parts {
		streams = append(streams, ">")
	}
	return c.read(ctx, streams, func(stream string) feed {
		for _, pt := range c.parts {
			if pt.stream == stream {
				return feed{part: pt}
			}
		}
		panic("fraud: XREADGROUP replied with a stream it was not asked for: " + stream)
	})
}

// readNew blocks up to Config.Block for new entries of f and processes them.
func (c *Consumer) readNew(ctx context.Context, f feed) (int, error) {
	return c.read(ctx, []string{f.stream, ">"}, func(string) feed { return f })
}

func (c *Consumer) read(ctx context.Context, streams []string, feedOf func(stream string) feed) (int, error) {
	res, err := c.rdb.XReadGroup(ctx, &redis.XReadGroupArgs{
		Group:    c.cfg.Group,
		Consumer: c.cfg.Consumer,
		Streams:  streams,
		Count:    int64(c.cfg.BatchSize),
		Block:    c.cfg.Block,
	}).Result()
	if errors.Is(err, redis.Nil) || isTimeout(err) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	n := 0
	for _, s := range res {
		n += len(s.Messages)
		f := feedOf(s.Stream)
		if err := c.adoptEarlier(ctx, f, s.Messages[0].ID); err != nil {
			return n, err
		}
		if err := c.handle(ctx, f, s.Messages, false); err != nil {
			return n, err
		}
	}
	return n, nil
}

// adoptEarlier claims and applies, before the entries from before on, the
// entries of f's partition still pending with other consumers that are older
// than before. The new owner of a partition applies every pending entry when
// it takes the partition over, but the previous owner, not knowing yet that
// it lost the lease, may read more entries after that (its XREADGROUP was
// blocked waiting for them): its effects are fenced, and the entries would
// stay in its pending list while the new owner applies the later ones.
// (Found by the chaos suite on a cluster: a sender's TED judged after the
// next one.) Only with partition ownership (f.fence set); entries pending
// with this consumer itself are retried as before.
func (c *Consumer) adoptEarlier(ctx context.Context, f feed, before string) error {
	if f.fence == "" {
		return nil
	}
	for ctx.Err() == nil {
		pending, err := c.rdb.XPendingExt(ctx, &redis.XPendingExtArgs{
			Stream: f.stream, Group: c.cfg.Group, Start: "-", End: "(" + before, Count: int64(c.cfg.BatchSize),
		}).Result()
		if err != nil {
			return fmt.Errorf("pending entries before %s: %w", before, err)
		}
		var ids []string
		for _, p := range pending {
			if p.Consumer != c.cfg.Consumer {
				ids = append(ids, p.ID)
			}
		}
		if len(ids) == 0 {
			return nil
		}
		msgs, err := c.rdb.XClaim(ctx, &redis.XClaimArgs{
			Stream: f.stream, Group: c.cfg.Group, Consumer: c.cfg.Consumer, Messages: ids,
		}).Result()
		if err != nil {
			return fmt.Errorf("xclaim earlier entries: %w", err)
		}
		c.log.Info("claimed earlier entries pending with another consumer", slog.Int("partition", f.n),
			slog.Int("entries", len(msgs)), slog.String("before", before))
		if err := c.handle(ctx, f, msgs, true); err != nil {
			return err
		}
	}
	return ctx.Err()
}

// ProcessPending re-reads and processes this consumer's own pending entries
// of every partition, from the oldest, until none is left that it has not
// tried in this pass (a single step of Run: see ReadNew).
func (c *Consumer) ProcessPending(ctx context.Context) error {
	for _, pt := range c.parts {
		if err := c.processPending(ctx, feed{part: pt}); err != nil {
			return err
		}
	}
	return nil
}

func (c *Consumer) processPending(ctx context.Context, f feed) error {
	cursor := "0"
	for ctx.Err() == nil {
		res, err := c.rdb.XReadGroup(ctx, &redis.XReadGroupArgs{
			Group:    c.cfg.Group,
			Consumer: c.cfg.Consumer,
			Streams:  []string{f.stream, cursor},
			Count:    int64(c.cfg.BatchSize),
			Block:    -1, // an explicit id never blocks; -1 leaves BLOCK out
		}).Result()
		if errors.Is(err, redis.Nil) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read pending: %w", err)
		}
		if len(res) == 0 || len(res[0].Messages) == 0 {
			return nil
		}
		msgs := res[0].Messages
		if err := c.handle(ctx, f, msgs, true); err != nil {
			return err
		}
		// Continue after the last entry, so an entry that failed again is
		// not re-read in a tight loop.
		cursor = msgs[len(msgs)-1].ID
	}
	return nil
}

// ClaimIdle claims the entries of every partition idle for at least
// ClaimMinIdle (their consumer died, or they keep failing) and processes
// them (a single step of Run: see ReadNew). It returns how many it claimed.
func (c *Consumer) ClaimIdle(ctx context.Context) (int, error) {
	total := 0
	for _, pt := range c.parts {
		n, err := c.claim(ctx, feed{part: pt}, c.cfg.ClaimMinIdle)
		total += n
		if err != nil {
			return total, err
		}
	}
	return total, nil
}

// claim claims f's entries idle for at least minIdle, from the oldest, and
// processes them. It returns how many it claimed.
func (c *Consumer) claim(ctx context.Context, f feed, minIdle time.Duration) (int, error) {
	start, total := "0-0", 0
	for ctx.Err() == nil {
		msgs, next, err := c.rdb.XAutoClaim(ctx, &redis.XAutoClaimArgs{
			Stream:   f.stream,
			Group:    c.cfg.Group,
			Consumer: c.cfg.Consumer,
			MinIdle:  minIdle,
			Start:    start,
			Count:    int64(c.cfg.BatchSize),
		}).Result()
		if err != nil {
			return total, fmt.Errorf("xautoclaim: %w", err)
		}
		total += len(msgs)
		if len(msgs) > 0 {
			c.log.Info("claimed pending entries", slog.Int("partition", f.n), slog.Int("entries", len(msgs)),
				slog.Duration("min_idle", minIdle))
			if err := c.handle(ctx, f, msgs, true); err != nil {
				return total, err
			}
		}
		if next == "0-0" || next == "" {
			break
		}
		start = next
	}
	return total, nil
}

// handle applies the effect of each entry and acknowledges the ones done.
// Once entries are read it finishes even if ctx is cancelled.
func (c *Consumer) handle(ctx context.Context, f feed, msgs []redis.XMessage, redelivered bool) error {
	ctx = context.WithoutCancel(ctx)
	started := time.Now()
	defer func() { c.cfg.Metrics.observeBatch(time.Since(started)) }()
	failpoint.Inject("fraud.after-read")
	attempt := c.deliveries(ctx, f, msgs, redelivered)

	type item struct {
		msg  redis.XMessage
		ev   Event
		cmd  *redis.Cmd
		span trace.Span
	}
	var (
		valid     []item
		bad       []redis.XMessage
		badEr     []error
		ack       []string
		transient error
	)
	for _, m := range msgs {
		if m.Values == nil {
			// Trimmed or deleted while pending: nothing left to process.
			c.stats.lost.Add(1)
			c.log.Error("pending entry has no payload (trimmed); acknowledging it", slog.String("entry_id", m.ID))
			ack = append(ack, m.ID)
			continue
		}
		ev, err := DecodeEntry(m.Values)
		if err != nil {
			bad, badEr = append(bad, m), append(badEr, err)
			continue
		}
		if want := partition.Of(ev.FromAccount, c.cfg.Partitions); want != f.n {
			// Its effects would land among another partition's keys: keep
			// it pending, loudly, until the configuration is fixed.
			c.stats.failed.Add(1)
			transient = fmt.Errorf("event %s of sender %s is in the stream of partition %d, but of %d partitions the sender's is %d: "+
				"the relay and this consumer disagree on the number of partitions", ev.EventID, ev.FromAccount, f.n, c.cfg.Partitions, want)
			continue
		}
		headers, _ := m.Values[entry.Headers].(string)
		_, span := tracer.Start(tracing.ExtractJSON(ctx, []byte(headers)), "fraud.process",
			trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(
				attribute.String("messaging.system", "redis"),
				attribute.String("messaging.destination.name", f.stream),
				attribute.String("messaging.message.id", ev.EventID.String()),
				attribute.String("messaging.consumer.group.name", c.cfg.Group)))
		valid = append(valid, item{msg: m, ev: ev, span: span})
	}

	if len(valid) > 0 {
		var wait *redis.Cmd
		node, err := c.pipelinerFor(ctx, f)
		if err != nil {
			for _, it := range valid {
				it.span.RecordError(err)
				it.span.End()
			}
			return err
		}
		run := func(items []item) error {
			_, err := node.Pipelined(ctx, func(p redis.Pipeliner) error {
				for i := range items {
					items[i].cmd = effectScript.EvalSha(ctx, p, c.effectKeys(f, items[i].ev), c.effectArgs(f, items[i].ev)...)
				}
				if c.cfg.MinReplicas > 0 {
					// On the connection that wrote the effects.
					wait = p.Do(ctx, "wait", c.cfg.MinReplicas, c.cfg.ReplicaTimeout.Milliseconds())
				}
				return nil
			})
			return err
		}
		if err := run(valid); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			// First use, or Redis restarted: load the script and run again.
			// Entries that did run were applied and are now duplicates.
			if lerr := effectScript.Load(ctx, c.rdb).Err(); lerr != nil {
				for _, it := range valid {
					it.span.RecordError(lerr)
					it.span.End()
				}
				return fmt.Errorf("load effect script: %w", lerr)
			}
			_ = run(valid) // per-entry errors are checked below
		}
		failpoint.Inject("fraud.after-effect")
		var unconfirmed error
		if wait != nil {
			if n, err := wait.Int64(); err != nil {
				unconfirmed = fmt.Errorf("wait for %d replicas: %w", c.cfg.MinReplicas, err)
			} else if n < int64(c.cfg.MinReplicas) {
				unconfirmed = fmt.Errorf("effects confirmed by %d of %d replicas within %s", n, c.cfg.MinReplicas, c.cfg.ReplicaTimeout)
			}
		}
		for _, it := range valid {
			outcome, revised, err := effectResult(it.cmd)
			if err == nil && unconfirmed != nil {
				err = unconfirmed
			}
			if err != nil {
				it.span.RecordError(err)
				it.span.SetStatus(codes.Error, err.Error())
				it.span.End()
				// Not the entry's fault (Redis busy, failing over, out of
				// memory...): it stays pending and is retried, however
				// often it is delivered. Only undecodable entries are
				// dead-lettered.
				c.stats.failed.Add(1)
				c.cfg.Metrics.failedEntry()
				if redis.HasErrorPrefix(err, "FENCED") {
					err = fmt.Errorf("%w: %w", errFenced, err)
				}
				if cc, ok := c.rdb.(*redis.ClusterClient); ok && (redis.HasErrorPrefix(err, "MOVED") || redis.HasErrorPrefix(err, "ASK")) {
					cc.ReloadState(ctx) // the slot moved under the master's own connection
				}
				transient = fmt.Errorf("apply event %s (entry %s): %w", it.ev.EventID, it.msg.ID, err)
				continue
			}
			ack = append(ack, it.msg.ID)
			log := c.log.With(slog.String("event_id", it.ev.EventID.String()),
				slog.String("event_type", "transfer.settled"),
				slog.String("aggregate_id", it.ev.TransferID.String()),
				slog.Int64("attempt", attempt(it.msg.ID)))
			it.span.SetAttributes(attribute.String("fraud.outcome", outcomeNames[outcome]))
			it.span.End()
			c.cfg.Metrics.outcome(outcomeNames[outcome])
			if c.cfg.OnProcessed != nil {
				c.cfg.OnProcessed(it.ev, outcomeNames[outcome])
			}
			if revised > 0 {
				log.Info("earlier transfer arrived late: later transfers of its sender sent to review",
					slog.Int64("revised", revised), slog.String("from_account", it.ev.FromAccount))
			}
			switch outcome {
			case outcomeDuplicate:
				c.stats.duplicates.Add(1)
				log.Debug("duplicate delivery skipped", slog.String("entry_id", it.msg.ID))
			case outcomeReview:
				c.stats.processed.Add(1)
				log.Info("transfer sent to review", slog.Int64("amount_cents", it.ev.AmountCents),
					slog.String("from_account", it.ev.FromAccount))
			default:
				c.stats.processed.Add(1)
			}
		}
	}

	if len(ack) > 0 {
		if err := c.rdb.XAck(ctx, f.stream, c.cfg.Group, ack...).Err(); err != nil {
			return fmt.Errorf("xack %d entries: %w", len(ack), err)
		}
	}
	for i, m := range bad {
		c.invalid(ctx, f, m, badEr[i])
	}
	return transient
}

// pipeliner is what handle needs to apply a batch of effects.
type pipeliner interface {
	Pipelined(ctx context.Context, fn func(redis.Pipeliner) error) ([]redis.Cmder, error)
}

// pipelinerFor returns where f's effects are pipelined: the client, or, on a
// Redis Cluster with MinReplicas, a connection to the master serving f's
// slot, so that the WAIT after the effects runs on the connection that wrote
// them (on a cluster client it would go to any node).
func (c *Consumer) pipelinerFor(ctx context.Context, f feed) (pipeliner, error) {
	cc, ok := c.rdb.(*redis.ClusterClient)
	if !ok || c.cfg.MinReplicas == 0 {
		return c.rdb, nil
	}
	node, err := cc.MasterForKey(ctx, f.stream)
	if err != nil {
		return nil, fmt.Errorf("find the master of partition %d: %w", f.n, err)
	}
	return node, nil
}

// deliveries returns each entry's delivery count, for logs. New entries are
// on their first delivery; redelivered ones (own pending, claimed) are looked
// up with one XPENDING call.
func (c *Consumer) deliveries(ctx context.Context, f feed, msgs []redis.XMessage, redelivered bool) func(id string) int64 {
	if !redelivered || len(msgs) == 0 {
		return func(string) int64 { return 1 }
	}
	counts := map[string]int64{}
	pend, err := c.rdb.XPendingExt(ctx, &redis.XPendingExtArgs{
		Stream: f.stream, Group: c.cfg.Group, Consumer: c.cfg.Consumer,
		Start: msgs[0].ID, End: msgs[len(msgs)-1].ID, Count: int64(len(msgs)),
	}).Result()
	if err == nil {
		for _, p := range pend {
			counts[p.ID] = p.RetryCount
		}
	}
	return func(id string) int64 { return counts[id] }
}

// invalid handles an entry that can never be processed: it stays pending (it
// is redelivered by ClaimIdle) until it has been delivered MaxDeliveries
// times, then it moves to the dead-letter stream.
func (c *Consumer) invalid(ctx context.Context, f feed, m redis.XMessage, cause error) {
	log := c.log.With(slog.String("entry_id", m.ID), slog.Any("error", cause))
	if id, ok := m.Values[entry.EventID].(string); ok {
		log = log.With(slog.String("event_id", id))
	}
	if t, ok := m.Values[entry.EventType].(string); ok {
		log = log.With(slog.String("event_type", t))
	}
	if a, ok := m.Values[entry.AggregateID].(string); ok {
		log = log.With(slog.String("aggregate_id", a))
	}
	c.stats.failed.Add(1)
	pend, err := c.rdb.XPendingExt(ctx, &redis.XPendingExtArgs{
		Stream: f.stream, Group: c.cfg.Group, Start: m.ID, End: m.ID, Count: 1,
	}).Result()
	if err != nil || len(pend) == 0 {
		log.Warn("invalid entry stays pending", slog.Any("xpending_error", err))
		return
	}
	deliveries := pend[0].RetryCount
	log = log.With(slog.Int64("attempt", deliveries))
	if deliveries < int64(c.cfg.MaxDeliveries) {
		log.Warn("invalid entry stays pending until its last delivery", slog.Int("max_deliveries", c.cfg.MaxDeliveries))
		return
	}
	moved, err := deadLetterScript.Run(ctx, c.rdb,
		[]string{f.stream, f.keys.DeadLetters(), f.keys.Stats()},
		c.cfg.Group, m.ID, cause.Error(), deliveries, c.cfg.Consumer).Int()
	if err != nil {
		log.Error("dead-lettering failed; entry stays pending", slog.Any("dlq_error", err))
		return
	}
	if moved == 1 {
		c.stats.deadLettered.Add(1)
		c.cfg.Metrics.deadLetter()
		log.Error("entry moved to the dead-letter stream", slog.String("dlq", f.keys.DeadLetters()))
	}
}

func (c *Consumer) effectKeys(f feed, ev Event) []string {
	day, _ := Day(ev.SettledAt)
	k := f.keys
	return []string{
		k.Seen(ev.EventID.String()), k.Verdict(ev.TransferID.String()),
		k.DayAccount(day, ev.FromAccount), k.DayAccounts(day), k.Days(),
		k.Window(ev.FromAccount), k.Stats(), k.Alerts(), k.Lease(c.cfg.Group), k.Approved(ev.FromAccount),
		k.Audit(),
	}
}

func (c *Consumer) effectArgs(f feed, ev Event) []any {
	now := time.Now()
	day, dayNo := Day(ev.SettledAt)
	expireAt := DayExpiry(ev.SettledAt, c.cfg.Retention).UnixMilli()
	if expireAt <= now.UnixMilli() {
		expireAt = 0 // settled longer ago than the retention: keep no verdict or totals
	}
	_, oldest := Day(now.Add(-c.cfg.Retention))
	ms := func(v int64) string { return strconv.FormatInt(v, 10) }
	return []any{
		int64(c.cfg.DedupeTTL / time.Second),
		ev.EventID.String(),
		ev.TransferID.String(),
		ev.FromAccount,
		ms(ev.AmountCents),
		ms(ev.SettledAt.UnixMilli()),
		ms(c.cfg.Window.Milliseconds()),
		ms(c.cfg.AmountLimitCents),
		ms(c.cfg.WindowLimitCents),
		ev.ToAccount,
		ev.Currency,
		ms(expireAt),
		day,
		ms(dayNo),
		ms(oldest - 1),
		ms((c.cfg.DedupeTTL + 2*c.cfg.Window).Milliseconds()),
		ms(now.Add(-c.cfg.Retention).UnixMilli()),
		f.keys.Verdict(""),
		f.fence,
		c.cfg.AuditLen,
	}
}

// effectResult reads effect.lua's reply: the outcome, and how many later
// transfers of the sender it sent to review.
func effectResult(cmd *redis.Cmd) (outcome int, revised int64, err error) {
	vals, err := cmd.Int64Slice()
	if err != nil {
		return 0, 0, err
	}
	if len(vals) != 2 {
		return 0, 0, fmt.Errorf("effect script replied %v, want {outcome, revised}", vals)
	}
	return int(vals[0]), vals[1], nil
}

// retryDelay backs off to 5s: a consumer failing on every entry must not spin.
func retryDelay(failures int) time.Duration {
	return retry.Backoff(failures, 100*time.Millisecond, 5*time.Second)
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// errFenced: the effect script refused an effect because the partition's
// lease no longer holds this consumer's value.
var errFenced = errors.New("partition lease lost")

// ErrNameInUse: another running consumer of the group has this consumer's
// name. Two processes under one name would share one pending list, each
// re-reading and acknowledging the other's entries.
var ErrNameInUse = errors.New("consumer name in use")

// nameLease is how a running consumer holds its name: the key
// Keys.Consumer(group, name) holds a random token of the process and lives
// nameLeaseTTL; the consumer renews it every loop. A consumer that crashed
// leaves it to expire.
func (c *Consumer) nameLeaseTTL() time.Duration { return 3*c.cfg.Block + time.Second }

// ensureNameFree takes the name's lease. If another process holds it, it
// watches the lease: one that is renewed (or taken over) belongs to a live
// consumer, and the name is refused; one that only runs down was left by a
// crash, and the name is taken when it expires.
func (c *Consumer) ensureNameFree(ctx context.Context) error {
	key := c.keys.Consumer(c.cfg.Group, c.cfg.Consumer)
	inUse := func() error {
		return fmt.Errorf("%w: consumer %q of group %s is running elsewhere (it keeps renewing %s); "+
			"give each consumer its own name (--consumer, or Config.Consumer)",
			ErrNameInUse, c.cfg.Consumer, c.cfg.Group, key)
	}
	var holder string
	var left time.Duration
	for {
		ok, err := c.rdb.SetNX(ctx, key, c.token, c.nameLeaseTTL()).Result()
		if err != nil {
			return fmt.Errorf("take the consumer name %q: %w", c.cfg.Consumer, err)
		}
		if ok {
			c.leaseRenewed = time.Now()
			return nil
		}
		v, verr := c.rdb.Get(ctx, key).Result()
		ttl, terr := c.rdb.PTTL(ctx, key).Result()
		switch {
		case errors.Is(verr, redis.Nil) || ttl == -2*time.Nanosecond:
			continue // expired just now
		case verr != nil || terr != nil:
			return fmt.Errorf("read the consumer name's lease %s: %w", key, errors.Join(verr, terr))
		case ttl < 0:
			return inUse() // no expiry: not a lease a crash could leave behind
		case holder != "" && (v != holder || ttl > left+50*time.Millisecond):
			return inUse() // renewed or taken over meanwhile: a live consumer
		}
		holder, left = v, ttl
		retry.Sleep(ctx, min(ttl+10*time.Millisecond, c.cfg.Block/2, time.Second))
		if err := ctx.Err(); err != nil {
			return err
		}
	}
}

// renewName extends the name's lease if a third of it has passed. Another
// process that took the name meanwhile (this one stalled past the TTL) is
// reported; the consumer goes on, as its effects stay exactly-once.
func (c *Consumer) renewName(ctx context.Context) {
	if time.Since(c.leaseRenewed) < c.nameLeaseTTL()/3 {
		return
	}
	key := c.keys.Consumer(c.cfg.Group, c.cfg.Consumer)
	prev, err := c.rdb.SetArgs(ctx, key, c.token, redis.SetArgs{TTL: c.nameLeaseTTL(), Get: true}).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return // Redis trouble shows in the read that follows
	}
	c.leaseRenewed = time.Now()
	if prev != "" && prev != c.token {
		c.log.Error("another process runs under this consumer name; give each consumer its own --consumer",
			slog.String("key", key))
	}
}

// releaseName gives the name back on a clean stop, so a successor need not
// wait for the lease to expire.
func (c *Consumer) releaseName() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	key := c.keys.Consumer(c.cfg.Group, c.cfg.Consumer)
	if v, err := c.rdb.Get(ctx, key).Result(); err == nil && v == c.token {
		c.rdb.Del(ctx, key)
	}
}
