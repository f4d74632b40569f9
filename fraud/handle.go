package fraud

import (
	"context"
	_ "embed"
	"fmt"
	"log/slog"
	"time"

	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/tedbank/outbox/internal/failpoint"
	"github.com/tedbank/outbox/internal/tracing"
	"github.com/tedbank/outbox/partition"
	"github.com/tedbank/outbox/relay/entry"
)

// handle applies the effect of each entry and acknowledges the ones done.
// Once entries are read it finishes even if ctx is cancelled.
func (c *Consumer) handle(ctx context.Context, f feed, msgs []redis.XMessage, redelivered bool) error {
	ctx = context.WithoutCancel(ctx)
	started := time.Now()
	defer func() { c.cfg.Metrics.observeBatch(time.Since(started)) }()
	failpoint.Inject("fraud.after-read")
	attempt := c.deliveries(ctx, f, msgs, redelivered)

	b := c.sortEntries(ctx, f, msgs)
	if len(b.valid) > 0 {
		unconfirmed, err := c.apply(ctx, f, b.valid)
		if err != nil {
			return err
		}
		failpoint.Inject("fraud.after-effect")
		for _, it := range b.valid {
			if err := c.settle(ctx, it, attempt, unconfirmed); err != nil {
				b.transient = err
				continue
			}
			b.ack = append(b.ack, it.msg.ID)
		}
	}
	if len(b.ack) > 0 {
		if err := c.rdb.XAck(ctx, f.stream, c.cfg.Group, b.ack...).Err(); err != nil {
			return fmt.Errorf("xack %d entries: %w", len(b.ack), err)
		}
	}
	for i, m := range b.bad {
		c.invalid(ctx, f, m, b.badErrs[i])
	}
	return b.transient
}

// item is an entry whose event decoded: its effect runs as cmd, under span.
type item struct {
	msg  redis.XMessage
	ev   Event
	cmd  *redis.Cmd
	span trace.Span
}

// sorted is a batch of entries sorted by what handle does with each.
type sorted struct {
	valid     []item           // apply the effect
	bad       []redis.XMessage // undecodable: pending until their last delivery, then dead-lettered
	badErrs   []error          // why each of bad failed to decode
	ack       []string         // done (or nothing left to do): acknowledge
	transient error            // the last entry left pending for a retry, and why
}

// sortEntries decodes msgs and starts a span for each valid event.
func (c *Consumer) sortEntries(ctx context.Context, f feed, msgs []redis.XMessage) sorted {
	var b sorted
	for _, m := range msgs {
		if m.Values == nil {
			// Trimmed or deleted while pending: nothing left to process.
			c.stats.lost.Add(1)
			c.log.Error("pending entry has no payload (trimmed); acknowledging it", slog.String("entry_id", m.ID))
			b.ack = append(b.ack, m.ID)
			continue
		}
		ev, err := DecodeEntry(m.Values)
		if err != nil {
			b.bad, b.badErrs = append(b.bad, m), append(b.badErrs, err)
			continue
		}
		if want := partition.Of(ev.FromAccount, c.cfg.Partitions); want != f.n {
			// Its effects would land among another partition's keys: keep
			// it pending, loudly, until the configuration is fixed.
			c.stats.failed.Add(1)
			b.transient = fmt.Errorf("event %s of sender %s is in the stream of partition %d, but of %d partitions the sender's is %d: "+
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
		b.valid = append(b.valid, item{msg: m, ev: ev, span: span})
	}
	return b
}

// apply runs the effect script for every item in one pipeline (loading the
// script first if Redis does not have it), followed, with MinReplicas, by a
// WAIT on the same connection. Each item's result is in its cmd; unconfirmed
// says why the replicas did not confirm the effects, if they did not. An
// error means no effect ran; the items' spans are then ended.
func (c *Consumer) apply(ctx context.Context, f feed, items []item) (unconfirmed, _ error) {
	endAll := func(err error) error {
		for _, it := range items {
			it.span.RecordError(err)
			it.span.End()
		}
		return err
	}
	node, err := c.pipelinerFor(ctx, f)
	if err != nil {
		return nil, endAll(err)
	}
	var wait *redis.Cmd
	run := func() error {
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
	if err := run(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
		// First use, or Redis restarted: load the script and run again.
		// Entries that did run were applied and are now duplicates.
		if lerr := effectScript.Load(ctx, c.rdb).Err(); lerr != nil {
			return nil, endAll(fmt.Errorf("load effect script: %w", lerr))
		}
		_ = run() // per-entry errors are checked by settle
	}
	if wait == nil {
		return nil, nil
	}
	if n, err := wait.Int64(); err != nil {
		return fmt.Errorf("wait for %d replicas: %w", c.cfg.MinReplicas, err), nil
	} else if n < int64(c.cfg.MinReplicas) {
		return fmt.Errorf("effects confirmed by %d of %d replicas within %s", n, c.cfg.MinReplicas, c.cfg.ReplicaTimeout), nil
	}
	return nil, nil
}

// settle reads one item's effect result, ends its span, and counts and logs
// the outcome. It returns an error if the item must stay pending for a
// retry: not the entry's fault (Redis busy, failing over, out of memory, the
// replicas did not confirm, the partition's lease was lost), so it is
// retried however often it is delivered; only undecodable entries are
// dead-lettered.
func (c *Consumer) settle(ctx context.Context, it item, attempt func(id string) int64, unconfirmed error) error {
	outcome, revised, err := effectResult(it.cmd)
	if err == nil && unconfirmed != nil {
		err = unconfirmed
	}
	if err != nil {
		it.span.RecordError(err)
		it.span.SetStatus(codes.Error, err.Error())
		it.span.End()
		c.stats.failed.Add(1)
		c.cfg.Metrics.failedEntry()
		if redis.HasErrorPrefix(err, "FENCED") {
			err = fmt.Errorf("%w: %w", errFenced, err)
		}
		if cc, ok := c.rdb.(*redis.ClusterClient); ok && movedSlot(err) {
			cc.ReloadState(ctx) // the slot moved under the master's own connection
		}
		return fmt.Errorf("apply event %s (entry %s): %w", it.ev.EventID, it.msg.ID, err)
	}
	log := c.log.With(slog.String("event_id", it.ev.EventID.String()),
		slog.String("event_type", "transfer.settled"),
		slog.String("aggregate_id", it.ev.TransferID.String()),
		slog.Int64("attempt", attempt(it.msg.ID)))
	it.span.SetAttributes(attribute.String("fraud.outcome", outcome.String()))
	it.span.End()
	c.cfg.Metrics.outcome(outcome)
	if c.cfg.Observer != nil {
		c.cfg.Observer.Processed(it.ev, outcome)
	}
	if revised > 0 {
		log.Info("earlier transfer arrived late: later transfers of its sender sent to review",
			slog.Int64("revised", revised), slog.String("from_account", it.ev.FromAccount))
	}
	switch outcome {
	case OutcomeDuplicate:
		c.stats.duplicates.Add(1)
		log.Debug("duplicate delivery skipped", slog.String("entry_id", it.msg.ID))
	case OutcomeReview:
		c.stats.processed.Add(1)
		log.Info("transfer sent to review", slog.Int64("amount_cents", it.ev.AmountCents),
			slog.String("from_account", it.ev.FromAccount))
	default:
		c.stats.processed.Add(1)
	}
	return nil
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

// movedSlot: a Redis Cluster redirection (MOVED, ASK) reached the consumer
// on a connection to one master.
func movedSlot(err error) bool {
	_, moved := redis.IsMovedError(err)
	_, ask := redis.IsAskError(err)
	return moved || ask
}
