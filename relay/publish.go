package relay

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/tedbank/outbox/internal/tracing"
	"github.com/tedbank/outbox/relay/entry"
)

// broker is where the relay publishes: Redis Streams (redisBroker, below;
// New) or NATS JetStream (jetStreamBroker, jetstream.go; NewJetStream).
type broker interface {
	// publish sends msgs[i] to dests[i], in claim (seq) order, and returns
	// each message's id at the broker (a stream entry id, a JetStream
	// sequence) or why it failed. It returns once the broker has confirmed
	// (or refused) each one; a message whose confirmation is lost may still
	// have arrived: it is published again, and consumers deduplicate.
	publish(ctx context.Context, msgs []message, dests []string) (ids []string, errs []error)
	// down reports whether a publish error means the broker as a whole
	// cannot take messages right now, as opposed to a problem of one event:
	// such failures count no attempt; the relay backs off and retries.
	down(err error) bool
	// ping checks that the broker answers.
	ping(ctx context.Context) error
}

// publishSpan starts the span of m's publication to dest on system
// ("redis", "nats"), continuing the writer's trace, and returns the headers
// the message carries on (the span's, when it records).
func publishSpan(ctx context.Context, m message, dest, system string) ([]byte, trace.Span) {
	// OpenTelemetry's messaging conventions: "send <destination>".
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

// endSpans ends each message's span, recording its error.
func endSpans(spans []trace.Span, errs []error) {
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

// redisBroker publishes to Redis Streams: an XADD per message, a batch in
// one pipeline (on a cluster with MinReplicas, one per master).
type redisBroker struct {
	rdb Pipeliner
	cfg Config
}

func (b *redisBroker) ping(ctx context.Context) error {
	_, err := b.rdb.Pipelined(ctx, func(p redis.Pipeliner) error { p.Ping(ctx); return nil })
	return err
}

func (b *redisBroker) down(err error) bool { return brokerUnavailable(err) }

// publish XADDs msgs (msgs[i] to streams[i]) in one pipeline, in claim (seq) order, and returns each
// message's stream entry id or error.
func (b *redisBroker) publish(ctx context.Context, msgs []message, streams []string) ([]string, []error) {
	ctx, cancel := context.WithTimeout(ctx, b.cfg.PublishTimeout)
	defer cancel()
	cmds := make([]*redis.StringCmd, len(msgs))
	spans := make([]trace.Span, len(msgs))
	unconfirmed := make([]error, len(msgs))
	if cc, ok := b.rdb.(*redis.ClusterClient); ok && b.cfg.MinReplicas > 0 {
		// WAIT counts the replicas that have the writes of its own
		// connection, on one node: pipeline each master's share on a
		// connection to that master, the masters side by side.
		var wg sync.WaitGroup
		for node, idx := range b.byMaster(ctx, cc, streams, unconfirmed) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				b.publishOn(ctx, node, idx, msgs, streams, cmds, spans, unconfirmed)
			}()
		}
		wg.Wait()
	} else {
		all := make([]int, len(msgs))
		for i := range all {
			all[i] = i
		}
		b.publishOn(ctx, b.rdb, all, msgs, streams, cmds, spans, unconfirmed)
	}
	ids := make([]string, len(msgs))
	errs := make([]error, len(msgs))
	for i, c := range cmds {
		if c == nil { // its master could not be found
			errs[i] = unconfirmed[i]
			continue
		}
		ids[i], errs[i] = c.Result()
		if errs[i] == nil && unconfirmed[i] != nil {
			errs[i] = unconfirmed[i]
		}
	}
	endSpans(spans, errs)
	if cc, ok := b.rdb.(*redis.ClusterClient); ok && slices.ContainsFunc(errs, movedSlot) {
		cc.ReloadState(ctx) // a slot moved under a master's own connection
	}
	return ids, errs
}

// byMaster groups the indexes of streams by the master node serving each
// stream's slot. An index whose master cannot be found gets its error in
// errs and no group.
func (b *redisBroker) byMaster(ctx context.Context, cc *redis.ClusterClient, streams []string, errs []error) map[Pipeliner][]int {
	groups := map[Pipeliner][]int{}
	nodes := map[string]*redis.Client{}
	for i, s := range streams {
		node, ok := nodes[s]
		if !ok {
			var err error
			if node, err = cc.MasterForKey(ctx, s); err != nil {
				errs[i] = fmt.Errorf("%w: find the master of %s: %w", errBrokerDown, s, err)
				continue
			}
			nodes[s] = node
		}
		groups[node] = append(groups[node], i)
	}
	return groups
}

// publishOn XADDs the messages idx in one pipeline on rdb, followed, when
// Config.MinReplicas is set, by a WAIT on the same connection; it fills cmds
// and spans, and unconfirmed for each entry the replicas did not confirm.
func (b *redisBroker) publishOn(ctx context.Context, rdb Pipeliner, idx []int, msgs []message, streams []string,
	cmds []*redis.StringCmd, spans []trace.Span, unconfirmed []error) {
	var wait *redis.Cmd
	_, _ = rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, i := range idx {
			m := msgs[i]
			// Continue the writer's trace; the entry carries this span on.
			var headers []byte
			headers, spans[i] = publishSpan(ctx, m, streams[i], "redis")
			cmds[i] = p.XAdd(ctx, &redis.XAddArgs{
				Stream: streams[i],
				Values: []any{
					entry.EventID, m.ID.String(),
					entry.EventType, m.EventType,
					entry.AggregateType, m.AggregateType,
					entry.AggregateID, m.AggregateID,
					entry.Payload, m.Payload,
					entry.Headers, headers,
					entry.OccurredAt, m.CreatedAt.UTC().Format(time.RFC3339Nano),
					entry.Seq, m.Seq,
					entry.PartitionKey, m.PartitionKey,
				},
			})
		}
		if b.cfg.MinReplicas > 0 {
			// On the pipeline's connection: WAIT counts the replicas that
			// have every write this connection made.
			wait = p.Do(ctx, "wait", b.cfg.MinReplicas, b.cfg.ReplicaTimeout.Milliseconds())
		}
		return nil
	})
	if wait == nil {
		return
	}
	var err error
	if n, werr := wait.Int64(); werr != nil {
		err = fmt.Errorf("%w: %w: %w", errBrokerDown, errNotReplicated, werr)
	} else if n < int64(b.cfg.MinReplicas) {
		err = fmt.Errorf("%w: %w: %d of %d replicas within %s", errBrokerDown, errNotReplicated, n, b.cfg.MinReplicas, b.cfg.ReplicaTimeout)
	}
	for _, i := range idx {
		unconfirmed[i] = err
	}
}
