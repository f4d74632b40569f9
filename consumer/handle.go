package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/tedbank/outbox/internal/failpoint"
	"github.com/tedbank/outbox/internal/tracing"
)

// handle applies the effect of each entry through the handler and
// acknowledges the ones done. Once entries are read it finishes even if ctx
// is cancelled.
func (c *Consumer) handle(ctx context.Context, f feed, msgs []redis.XMessage, redelivered bool) error {
	ctx = context.WithoutCancel(ctx)
	started := time.Now()
	defer func() { c.cfg.Metrics.observeBatch(time.Since(started)) }()
	failpoint.Inject(c.afterRead)
	attempt := c.deliveries(ctx, f, msgs, redelivered)

	b := c.sortEntries(ctx, f, msgs, attempt)
	if len(b.valid) > 0 {
		batch := Batch{Partition: f.n, Stream: f.stream, Keys: f.keys, Fence: f.fence, Group: c.cfg.Group,
			Messages: make([]Message, len(b.valid))}
		for i, it := range b.valid {
			batch.Messages[i] = it.msg
		}
		results := c.handler.Handle(ctx, batch)
		if len(results) != len(b.valid) {
			err := fmt.Errorf("the handler returned %d results for %d messages", len(results), len(b.valid))
			results = make([]Result, len(b.valid))
			for i := range results {
				results[i].Err = err
			}
		}
		failpoint.Inject(c.afterEffect)
		for i, it := range b.valid {
			switch err := c.settle(ctx, it, results[i]); {
			case err == nil:
				b.ack = append(b.ack, it.msg.EntryID)
			case errors.Is(err, ErrInvalid):
				b.bad = append(b.bad, invalidEntry{id: it.msg.EntryID, values: it.values, err: err})
			default:
				b.transient = err
			}
		}
	}
	if len(b.ack) > 0 {
		if err := c.rdb.XAck(ctx, f.stream, c.cfg.Group, b.ack...).Err(); err != nil {
			return fmt.Errorf("xack %d entries: %w", len(b.ack), err)
		}
	}
	for _, bad := range b.bad {
		c.invalid(ctx, f, bad)
	}
	return b.transient
}

// item is an entry whose envelope decoded: its handling runs under span.
type item struct {
	msg    Message
	values map[string]any // the entry's fields, for the logs of an invalid one
	span   trace.Span
}

// invalidEntry is an entry that can never be applied, and why.
type invalidEntry struct {
	id     string
	values map[string]any
	err    error
}

// sorted is a batch of entries sorted by what handle does with each.
type sorted struct {
	valid     []item         // hand to the handler
	bad       []invalidEntry // pending until their last delivery, then dead-lettered
	ack       []string       // done (or nothing left to do): acknowledge
	transient error          // the last entry left pending for a retry, and why
}

// sortEntries decodes msgs and starts a span for each valid one.
func (c *Consumer) sortEntries(ctx context.Context, f feed, msgs []redis.XMessage, attempt func(id string) int64) sorted {
	var b sorted
	for _, x := range msgs {
		if x.Values == nil {
			// Trimmed or deleted while pending: nothing left to process.
			c.stats.lost.Add(1)
			c.log.Error("pending entry has no payload (trimmed); acknowledging it", slog.String("entry_id", x.ID))
			b.ack = append(b.ack, x.ID)
			continue
		}
		m, err := messageOf(x, f.n)
		if err != nil {
			b.bad = append(b.bad, invalidEntry{id: x.ID, values: x.Values, err: err})
			continue
		}
		m.Attempt = attempt(x.ID)
		_, span := tracer.Start(tracing.ExtractJSON(ctx, m.Headers), c.cfg.Name+".process",
			trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(
				attribute.String("messaging.system", "redis"),
				attribute.String("messaging.destination.name", f.stream),
				attribute.String("messaging.message.id", m.ID.String()),
				attribute.String("messaging.consumer.group.name", c.cfg.Group)))
		b.valid = append(b.valid, item{msg: m, values: x.Values, span: span})
	}
	return b
}

// settle ends one item's span and counts and logs its result. It returns
// the item's error, if it must stay pending.
func (c *Consumer) settle(ctx context.Context, it item, r Result) error {
	if r.Err != nil {
		it.span.RecordError(r.Err)
		it.span.SetStatus(codes.Error, r.Err.Error())
		it.span.End()
		if !errors.Is(r.Err, ErrInvalid) { // counted when it is dead-lettered or kept
			c.stats.failed.Add(1)
			c.cfg.Metrics.failedEntry()
		}
		return fmt.Errorf("apply event %s (entry %s): %w", it.msg.ID, it.msg.EntryID, r.Err)
	}
	it.span.SetAttributes(attribute.String(c.outcomeAttr, r.Outcome))
	it.span.End()
	c.cfg.Metrics.outcome(r.Outcome)
	if r.Outcome == Duplicate {
		c.stats.duplicates.Add(1)
		c.log.Debug("duplicate delivery skipped", slog.String("entry_id", it.msg.EntryID),
			slog.String("event_id", it.msg.ID.String()), slog.Int64("attempt", it.msg.Attempt))
		return nil
	}
	c.stats.processed.Add(1)
	return nil
}
