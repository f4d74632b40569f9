package relay

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/trace"

	"github.com/tedbank/outbox/internal/natsjs"
	"github.com/tedbank/outbox/relay/entry"
)

// JetStream says where a relay publishes on NATS JetStream (NewJetStream).
type JetStream struct {
	JS jetstream.JetStream
	// Stream is the JetStream stream that captures the relay's subjects
	// (Config.StreamPrefix + ">"), created or updated before the first
	// publish. Default "OUTBOX".
	Stream string
	// Duplicates is the stream's duplicate window: the server drops a
	// re-publication of an event (Nats-Msg-Id is the event id) within it.
	// Default 2 minutes.
	Duplicates time.Duration
	// MaxAge is how long the stream keeps a message, read or not. Default
	// 7 days.
	MaxAge time.Duration
	// Replicas is the stream's replication in a clustered JetStream.
	Replicas int
}

// NewJetStream returns a relay that claims from pool and publishes to NATS
// JetStream: each event to the subject that would be its Redis stream's
// name, with Nats-Msg-Id set to its event id, marked published once the
// server has acknowledged it. Trimming does not apply (the stream's MaxAge
// does); everything else is as with New.
func NewJetStream(pool *pgxpool.Pool, js JetStream, cfg Config) (*Relay, error) {
	r, err := newRelay(pool, cfg)
	if err != nil {
		return nil, err
	}
	if js.JS == nil {
		return nil, fmt.Errorf("%w: no JetStream context", ErrConfig)
	}
	stream := natsjs.Stream{Name: js.Stream, SubjectPrefix: r.cfg.StreamPrefix, Duplicates: js.Duplicates,
		MaxAge: js.MaxAge, Replicas: js.Replicas}
	if err := stream.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	r.broker = &jetStreamBroker{js: js.JS, stream: stream, name: cmp.Or(js.Stream, natsjs.DefaultStream), timeout: r.cfg.PublishTimeout}
	return r, nil
}

// jetStreamBroker publishes to NATS JetStream: a batch asynchronously, then
// every acknowledgement awaited.
type jetStreamBroker struct {
	js      jetstream.JetStream
	stream  natsjs.Stream
	name    string // the stream's name, with its default
	timeout time.Duration

	mu      sync.Mutex
	ensured bool // the stream exists with its settings (again after it was found missing)
}

func (b *jetStreamBroker) ping(ctx context.Context) error {
	_, err := b.js.AccountInfo(ctx)
	return err
}

func (b *jetStreamBroker) down(err error) bool {
	return errors.Is(err, errBrokerDown) || natsjs.Down(err)
}

// prepare creates or updates the stream when the relay starts.
func (b *jetStreamBroker) prepare(ctx context.Context) error { return b.ensure(ctx) }

// ensure creates or updates the stream once, and again after a publish
// found no stream.
func (b *jetStreamBroker) ensure(ctx context.Context) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.ensured {
		return nil
	}
	if _, err := natsjs.Ensure(ctx, b.js, b.stream); err != nil {
		return fmt.Errorf("%w: %w", errBrokerDown, err)
	}
	b.ensured = true
	return nil
}

func (b *jetStreamBroker) publish(ctx context.Context, msgs []message, subjects []string) ([]string, []error) {
	ctx, cancel := context.WithTimeout(ctx, b.timeout)
	defer cancel()
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
		headers, spans[i] = publishSpan(ctx, m, subjects[i], "nats")
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
			errs[i] = fmt.Errorf("%w: no acknowledgement from JetStream: %w", errBrokerDown, ctx.Err())
		}
	}
	endSpans(spans, errs)
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
