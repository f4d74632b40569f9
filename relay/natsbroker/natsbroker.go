// Package natsbroker publishes a relay's events to NATS JetStream: each
// event to the subject that would be its Redis stream's name, its body the
// payload, the stream entry's fields as headers and Nats-Msg-Id its event id
// (the server drops a re-publication within its duplicate window). A batch
// is published asynchronously, then every acknowledgement awaited.
//
// Only services that publish to NATS import this package: relay and consumer
// link no NATS client.
package natsbroker

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"

	"github.com/tedbank/outbox/internal/natsjs"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/relay/broker"
	"github.com/tedbank/outbox/relay/entry"
)

// Config says where a relay publishes on NATS JetStream.
type Config struct {
	JS jetstream.JetStream
	// Stream is the JetStream stream that captures the relay's subjects
	// (SubjectPrefix + ">"), created or updated before the first publish.
	// Default "OUTBOX".
	Stream string
	// SubjectPrefix is the relay's Config.StreamPrefix (NewRelay sets it).
	SubjectPrefix string
	// Duplicates is the stream's duplicate window: the server drops a
	// re-publication of an event (Nats-Msg-Id is the event id) within it.
	// Default 2 minutes.
	Duplicates time.Duration
	// MaxAge is how long the stream keeps a message, read or not. Default
	// 7 days.
	MaxAge time.Duration
	// Replicas is the stream's replication in a clustered JetStream.
	Replicas int
	// CloudEvents adds each event's CloudEvents attributes as headers, both
	// as the NATS protocol binding names them ("ce-id", ...: what the
	// CloudEvents SDKs read) and as the stream entries do ("ce_id", ...),
	// with content-type. NewRelay takes it from relay.Config.
	CloudEvents broker.CloudEvents
}

// NewRelay returns a relay that claims from pool and publishes to NATS
// JetStream, marking each event published once the server has acknowledged
// it. Trimming does not apply (the stream's MaxAge does); everything else is
// as with relay.New.
func NewRelay(pool *pgxpool.Pool, c Config, rc relay.Config) (*relay.Relay, error) {
	if rc.StreamPrefix == "" && rc.Stream == "" {
		rc.StreamPrefix = relay.DefaultStreamPrefix
	}
	c.SubjectPrefix = rc.StreamPrefix
	b, err := New(c)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", relay.ErrConfig, err)
	}
	return relay.New(pool, b, rc)
}

// Broker publishes to NATS JetStream.
type Broker struct {
	js     jetstream.JetStream
	stream natsjs.Stream
	name   string // the stream's name, with its default
	ce     broker.CloudEvents

	mu      sync.Mutex
	ensured bool // the stream exists with its settings (again after it was found missing)
}

var (
	_ broker.Broker   = (*Broker)(nil)
	_ broker.Preparer = (*Broker)(nil)
)

// New returns a broker publishing to c.JS.
func New(c Config) (*Broker, error) {
	if c.JS == nil {
		return nil, errors.New("no JetStream context")
	}
	stream := natsjs.Stream{Name: c.Stream, SubjectPrefix: c.SubjectPrefix, Duplicates: c.Duplicates,
		MaxAge: c.MaxAge, Replicas: c.Replicas}
	if err := stream.Validate(); err != nil {
		return nil, err
	}
	if err := c.CloudEvents.Validate(); err != nil {
		return nil, err
	}
	return &Broker{js: c.JS, stream: stream, name: cmp.Or(c.Stream, natsjs.DefaultStream), ce: c.CloudEvents}, nil
}

// Ping checks that the JetStream account answers.
func (b *Broker) Ping(ctx context.Context) error {
	_, err := b.js.AccountInfo(ctx)
	return err
}

// Unavailable reports whether err means JetStream cannot take messages now.
func (b *Broker) Unavailable(err error) bool {
	return errors.Is(err, broker.ErrUnavailable) || natsjs.Down(err)
}

// MaybeSent reports whether a publish that failed with err may still have
// reached the stream: not when nothing left the client or no stream took it.
// nats.ErrDisconnected may have: nats.go fails every publish still awaiting
// its acknowledgement with it when the connection is replaced, whether the
// server stored the message or not.
func (b *Broker) MaybeSent(err error) bool {
	var opErr *net.OpError
	switch {
	case err == nil:
		return false
	case errors.As(err, &opErr) && opErr.Op == "dial":
		return false
	case errors.Is(err, nats.ErrNoResponders), errors.Is(err, nats.ErrConnectionClosed),
		errors.Is(err, nats.ErrConnectionReconnecting), errors.Is(err, nats.ErrConnectionDraining),
		errors.Is(err, jetstream.ErrStreamNotFound), errors.Is(err, jetstream.ErrTooManyStalledMsgs):
		return false
	}
	return true
}

// Prepare creates or updates the stream when the relay starts.
func (b *Broker) Prepare(ctx context.Context) error { return b.ensure(ctx) }

// ensure creates or updates the stream once, and again after a publish
// found no stream.
func (b *Broker) ensure(ctx context.Context) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.ensured {
		return nil
	}
	if _, err := natsjs.Ensure(ctx, b.js, b.stream); err != nil {
		return fmt.Errorf("%w: %w", broker.ErrUnavailable, err)
	}
	b.ensured = true
	return nil
}

// Publish sends msgs[i] to subjects[i] asynchronously and awaits every
// acknowledgement; each id is the message's stream sequence.
func (b *Broker) Publish(ctx context.Context, msgs []broker.Message, subjects []string) ([]string, []error) {
	ids := make([]string, len(msgs))
	errs := make([]error, len(msgs))
	if err := b.ensure(ctx); err != nil {
		for i := range errs {
			errs[i] = err
		}
		return ids, errs
	}
	spans := make([]trace.Span, len(msgs))
	futures := make([]jetstream.PubAckFuture, len(msgs))
	for i, m := range msgs {
		var headers []byte
		headers, spans[i] = broker.StartSpan(ctx, m, subjects[i], "nats")
		msg := &nats.Msg{Subject: subjects[i], Data: []byte(m.Payload), Header: nats.Header{
			jetstream.MsgIDHeader: {m.ID.String()},
			entry.EventID:         {m.ID.String()},
			entry.EventType:       {m.EventType},
			entry.AggregateType:   {m.AggregateType},
			entry.AggregateID:     {m.AggregateID},
			entry.Headers:         {string(headers)},
			entry.OccurredAt:      {m.CreatedAt.UTC().Format(time.RFC3339Nano)},
			entry.Seq:             {strconv.FormatInt(m.Seq, 10)},
			entry.PartitionKey:    {m.PartitionKey},
		}}
		if attrs := b.ce.Attributes(m); attrs != nil {
			for _, a := range attrs {
				msg.Header[entry.CEHeaderPrefix+a.Name] = []string{a.Value}
				msg.Header[entry.CEFieldPrefix+a.Name] = []string{a.Value}
			}
			msg.Header[entry.ContentType] = []string{broker.ContentType}
		}
		futures[i], errs[i] = b.js.PublishMsgAsync(msg, jetstream.WithExpectStream(b.name))
	}
	for i, f := range futures {
		if f == nil {
			continue
		}
		select {
		case ack := <-f.Ok():
			// A duplicate (ack.Duplicate: the server had the Nats-Msg-Id
			// within its window) is published too: the sequence is the
			// first copy's (TestJetStreamPublishesEachEventOnce).
			ids[i] = strconv.FormatUint(ack.Sequence, 10)
		case err := <-f.Err():
			errs[i] = err
		case <-ctx.Done():
			errs[i] = fmt.Errorf("%w: no acknowledgement from JetStream: %w", broker.ErrUnavailable, ctx.Err())
		}
	}
	broker.EndSpans(spans, errs)
	if slices.ContainsFunc(errs, natsjs.Stale) {
		// Acknowledgements that never came: the connection may be
		// half-open. A new one for the retry.
		_ = b.js.Conn().ForceReconnect()
	}
	for _, err := range errs {
		if errors.Is(err, jetstream.ErrNoStreamResponse) || errors.Is(err, nats.ErrNoResponders) || errors.Is(err, jetstream.ErrStreamNotFound) {
			b.mu.Lock()
			b.ensured = false // deleted? create it again before the retry
			b.mu.Unlock()
			break
		}
	}
	return ids, errs
}
