// Package broker is the seam between the relay and where it publishes.
//
// A relay (package relay) claims outbox rows, hands them to a Broker in one
// call per batch, and records what the Broker says of each: published (with
// the broker's id of it), refused one by one (an attempt counted, retried
// with backoff), or refused because the broker as a whole is unavailable (no
// attempt counted; the relay backs off and retries the batch). Redis Streams
// (package relay/redisbroker) and NATS JetStream
// (package relay/natsbroker) are the two implementations; the relay's tests
// and the conformance suite (internal/conformance) run against each, and
// package relay/broker/brokertest is the kit every Broker must pass.
package broker

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/tedbank/outbox/internal/tracing"
)

// Message is one claimed outbox event, as a Broker publishes it.
type Message struct {
	ID            uuid.UUID
	Seq           int64 // the outbox row's sequence: per-key order
	AggregateType string
	AggregateID   string
	EventType     string
	Payload       []byte
	Headers       []byte // JSON; carries the writer's trace context
	Attempts      int    // publish attempts recorded before this one
	CreatedAt     time.Time
	PartitionKey  string
}

// Broker is where a relay publishes. An implementation starts each
// message's span with StartSpan, sends the headers it returns (they carry
// the trace on to the consumers) and ends the spans with EndSpans; it
// writes the fields of package relay/entry (and, when asked, the
// CloudEvents attributes) under their names.
type Broker interface {
	// Publish sends msgs[i] to dests[i], in claim (seq) order, and returns
	// each message's id at the broker (a stream entry id, a JetStream
	// sequence) or why it failed. It returns once the broker has confirmed
	// (or refused) each one, or ctx is done (the relay bounds it with
	// Config.PublishTimeout). A message whose confirmation is lost may still
	// have arrived: it is published again, and consumers deduplicate.
	Publish(ctx context.Context, msgs []Message, dests []string) (ids []string, errs []error)
	// Unavailable reports whether a publish error means the broker as a
	// whole cannot take messages right now (down, unreachable, refusing
	// writes), as opposed to a problem of one message. Errors wrapping
	// ErrUnavailable are.
	Unavailable(err error) bool
	// MaybeSent reports whether a publish that failed with err may still
	// have reached the broker (a lost or late reply), as opposed to a
	// refusal or a message that never left the client. The relay starts
	// such a message's redelivery window.
	MaybeSent(err error) bool
	// Ping checks that the broker answers (relay.Ready).
	Ping(ctx context.Context) error
}

// Preparer is a Broker with work to do before the first publish (create a
// stream): the relay calls Prepare when it starts, best effort.
type Preparer interface {
	Prepare(ctx context.Context) error
}

// Checker is a Broker with conditions to check before the relay starts
// (redisbroker refuses a Redis that evicts keys): relay.Run returns Check's
// error without starting.
type Checker interface {
	Check(ctx context.Context) error
}

// Maintainer is a Broker with background work beside the publishing
// (redisbroker trims its streams): relay.Run runs Maintain on a goroutine of
// its own until ctx ends.
type Maintainer interface {
	Maintain(ctx context.Context)
}

// ErrUnavailable marks errors that mean the broker as a whole is unavailable.
var ErrUnavailable = errors.New("broker unavailable")

var tracer = tracing.Tracer("github.com/tedbank/outbox/relay")

// StartSpan starts the span of m's publication to dest on system ("redis",
// "nats"), following OpenTelemetry's messaging conventions ("send <dest>"),
// continuing the writer's trace. It returns the headers the message carries
// on: the span's context, when it records.
func StartSpan(ctx context.Context, m Message, dest, system string) ([]byte, trace.Span) {
	sctx, span := tracer.Start(tracing.ExtractJSON(ctx, m.Headers), "send "+dest,
		trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(
			attribute.String("messaging.system", system),
			attribute.String("messaging.operation.type", "send"),
			attribute.String("messaging.operation.name", "send"),
			attribute.String("messaging.destination.name", dest),
			attribute.String("messaging.message.id", m.ID.String()),
			attribute.String("outbox.event_type", m.EventType)))
	headers := m.Headers
	if span.IsRecording() {
		headers = tracing.ReplaceJSON(sctx, headers)
	}
	return headers, span
}

// EndSpans ends each span (nil ones skipped), recording errs[i] on spans[i].
func EndSpans(spans []trace.Span, errs []error) {
	for i, span := range spans {
		if span == nil {
			continue
		}
		if errs[i] != nil {
			span.RecordError(errs[i])
			span.SetStatus(codes.Error, errs[i].Error())
		}
		span.End()
	}
}

// CloudEvents says whether a broker adds each message's CloudEvents 1.0
// attributes (binary content mode: the payload is the event's data) to the
// fields it always writes (package relay/entry's CE* names).
type CloudEvents struct {
	Enabled bool
	// Source is the ce_source attribute; empty: "/outbox/<aggregate_type>".
	Source string
}

// Validate reports a CloudEvents setting that cannot work.
func (c CloudEvents) Validate() error {
	switch {
	case c.Source != "" && !c.Enabled:
		return fmt.Errorf("CloudEvents source %q given with CloudEvents off: turn them on (--cloudevents) or leave the source out", c.Source)
	case c.Source != "" && !uriReference(c.Source):
		return fmt.Errorf("CloudEvents source %q: must be a URI reference without spaces (such as /bank/ted or urn:bank:ted)", c.Source)
	}
	return nil
}

// uriReference reports whether s is a URI reference (RFC 3986), as
// CloudEvents' source must be.
func uriReference(s string) bool {
	if strings.ContainsFunc(s, func(r rune) bool { return r <= ' ' || r == 0x7f }) {
		return false
	}
	_, err := url.Parse(s)
	return err == nil
}

// Attribute is one CloudEvents attribute, named without a prefix ("id").
type Attribute struct{ Name, Value string }

// ContentType is the payload's media type (datacontenttype): the outbox
// payload is JSON.
const ContentType = "application/json"

// Attributes returns m's CloudEvents attributes, or nil when c is not
// enabled.
func (c CloudEvents) Attributes(m Message) []Attribute {
	if !c.Enabled {
		return nil
	}
	source := c.Source
	if source == "" {
		source = "/outbox/" + m.AggregateType
	}
	return []Attribute{
		{"specversion", "1.0"},
		{"id", m.ID.String()},
		{"type", m.EventType},
		{"source", source},
		{"time", m.CreatedAt.UTC().Format(time.RFC3339Nano)},
		{"partitionkey", m.PartitionKey},
	}
}
