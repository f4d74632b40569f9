package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/tedbank/outbox/internal/failpoint"
	"github.com/tedbank/outbox/internal/tracing"
	"github.com/tedbank/outbox/relay/entry"
)

// delivery is one message as its broker delivered it.
type delivery struct {
	id      string         // the broker's id of it: a stream entry id, a JetStream sequence
	values  map[string]any // its fields as the relay wrote them (relay/entry); nil: trimmed while pending
	attempt int64          // its delivery count
	key     string         // its partition key, its unit of order ("": none written)
}

func newDelivery(id string, values map[string]any, attempt int64) delivery {
	key, _ := values[entry.PartitionKey].(string)
	return delivery{id: id, values: values, attempt: attempt, key: key}
}

// applied is what became of a read's deliveries.
type applied struct {
	ack       []int          // the deliveries done (or with nothing left to do), by index
	bad       []invalidEntry // never applicable: pending until their last delivery, then dead-lettered
	held      []int          // left pending behind an earlier message of their key, by index
	transient error          // the last delivery left pending for a retry, and why
}

// apply decodes ds, runs the handler on the valid ones that the partition's
// gate admits (order.go) and sorts the outcome; system names the broker in
// the spans.
func (c *Consumer) apply(ctx context.Context, f feed, ds []delivery, system string) applied {
	var done applied
	var valid []item
	admitted := f.gate.admit(ds)
	for i, d := range ds {
		if d.values == nil {
			// Trimmed or deleted while pending: nothing left to process.
			c.stats.lost.Add(1)
			c.log.Error("pending entry has no payload (trimmed); acknowledging it", slog.String("entry_id", d.id))
			done.ack = append(done.ack, i)
			f.gate.done(d.id, d.key)
			continue
		}
		if !admitted[i] {
			// An earlier entry of its key is pending for a retry.
			done.held = append(done.held, i)
			f.gate.pending(d.id, d.key)
			continue
		}
		m, err := DecodeEntry(d.id, d.values)
		if err != nil {
			done.bad = append(done.bad, invalidEntry{index: i, id: d.id, values: d.values, err: err})
			f.gate.invalidPending(d.id, d.key)
			continue
		}
		m.Partition, m.Attempt = f.n, d.attempt
		valid = append(valid, item{index: i, msg: m, values: d.values, span: c.startSpan(ctx, f, m, system)})
	}
	if len(valid) == 0 {
		return done
	}
	batch := Batch{Partition: f.n, Stream: f.stream, Keys: f.keys, Fence: f.fence, Group: c.cfg.Group,
		Messages: make([]Message, len(valid))}
	for i, it := range valid {
		batch.Messages[i] = it.msg
	}
	results := c.handler.Handle(ctx, batch)
	if len(results) != len(valid) {
		err := fmt.Errorf("the handler returned %d results for %d messages", len(results), len(valid))
		results = make([]Result, len(valid))
		for i := range results {
			results[i].Err = err
		}
	}
	failpoint.Inject(c.afterEffect)
	var order Order
	for i, it := range valid {
		r := results[i]
		if r.Err == nil && r.Outcome != Duplicate && order.Holds(it.msg) {
			// The handler broke its contract (Handler): nothing can undo
			// the effect now, but it must not go unnoticed.
			c.log.Error("per-key order broken: the handler applied a message after an earlier one of its key failed",
				slog.String("event_id", it.msg.ID.String()), slog.String("key", it.msg.Key), slog.String("entry_id", it.msg.EntryID))
		}
		order.Failed(it.msg, r.Err)
		d := ds[it.index]
		switch err := c.settle(ctx, it, r); {
		case err == nil:
			done.ack = append(done.ack, it.index)
			f.gate.done(d.id, d.key)
		case errors.Is(err, ErrInvalid):
			done.bad = append(done.bad, invalidEntry{index: it.index, id: it.msg.EntryID, values: it.values, err: err})
			f.gate.invalidPending(d.id, d.key)
		case errors.Is(err, ErrHeld):
			done.held = append(done.held, it.index)
			f.gate.pending(d.id, d.key)
		default:
			done.transient = err
			f.gate.pending(d.id, d.key)
		}
	}
	return done
}

// item is a delivery whose envelope decoded: its handling runs under span.
type item struct {
	index  int // of its delivery
	msg    Message
	values map[string]any // the entry's fields, for the logs of an invalid one
	span   trace.Span
}

// invalidEntry is a delivery that can never be applied, and why.
type invalidEntry struct {
	index  int // of its delivery
	id     string
	values map[string]any
	err    error
}

// startSpan starts the span of m's handling, continuing the trace its
// headers carry.
func (c *Consumer) startSpan(ctx context.Context, f feed, m Message, system string) trace.Span {
	// OpenTelemetry's messaging conventions: "process <destination>"; the
	// consumer's name (fraud, ledger, ...) is outbox.consumer.
	_, span := tracer.Start(tracing.ExtractJSON(ctx, m.Headers), "process "+f.stream,
		trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(
			attribute.String("messaging.system", system),
			attribute.String("messaging.operation.type", "process"),
			attribute.String("messaging.operation.name", "process"),
			attribute.String("outbox.consumer", c.cfg.Name),
			attribute.String("messaging.destination.name", f.stream),
			attribute.String("messaging.message.id", m.ID.String()),
			attribute.String("messaging.consumer.group.name", c.cfg.Group)))
	return span
}

// settle ends one item's span and counts and logs its result. It returns
// the item's error, if it must stay pending.
func (c *Consumer) settle(ctx context.Context, it item, r Result) error {
	if errors.Is(r.Err, ErrHeld) {
		it.span.SetAttributes(attribute.String(c.outcomeAttr, "held"))
		it.span.End()
		return r.Err
	}
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
