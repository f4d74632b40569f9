// Package redisbroker publishes a relay's events to Redis Streams: an XADD
// per event, a batch in one pipeline. It is the broker of relay.New; a
// service that builds its relay with relay.NewWithBroker can use it directly.
package redisbroker

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/trace"

	"github.com/tedbank/outbox/relay/broker"
	"github.com/tedbank/outbox/relay/entry"
)

// Pipeliner is what the broker needs from Redis: *redis.Client and
// *redis.ClusterClient satisfy it.
type Pipeliner interface {
	Pipelined(ctx context.Context, fn func(redis.Pipeliner) error) ([]redis.Cmder, error)
}

// Config says how the broker confirms a publish.
type Config struct {
	// MinReplicas: after each pipeline the broker waits (Redis WAIT, on the
	// pipeline's connection; on a cluster, one per master) for this many
	// replicas to have the entries, ReplicaTimeout at most. Entries not
	// confirmed are reported ErrNotReplicated (the broker unavailable).
	MinReplicas int
	// ReplicaTimeout bounds the WAIT. Required with MinReplicas.
	ReplicaTimeout time.Duration
	// CloudEvents adds each event's CloudEvents attributes to its entry
	// (entry.CEID, ...), after the fields it always has.
	CloudEvents broker.CloudEvents
}

// ErrNotReplicated: Redis took the entries, but fewer replicas than
// Config.MinReplicas confirmed them in time.
var ErrNotReplicated = errors.New("not confirmed by enough replicas")

// Broker publishes to Redis Streams.
type Broker struct {
	rdb Pipeliner
	cfg Config
}

var _ broker.Broker = (*Broker)(nil)

// New returns a broker publishing to rdb.
func New(rdb Pipeliner, cfg Config) (*Broker, error) {
	switch {
	case rdb == nil:
		return nil, errors.New("redisbroker: no Redis client")
	case cfg.MinReplicas < 0:
		return nil, fmt.Errorf("redisbroker: min replicas %d: must not be negative", cfg.MinReplicas)
	case cfg.MinReplicas > 0 && cfg.ReplicaTimeout < time.Millisecond:
		return nil, fmt.Errorf("redisbroker: replica timeout %s: must be at least 1ms", cfg.ReplicaTimeout)
	}
	return &Broker{rdb: rdb, cfg: cfg}, nil
}

// Ping checks that Redis answers.
func (b *Broker) Ping(ctx context.Context) error {
	_, err := b.rdb.Pipelined(ctx, func(p redis.Pipeliner) error { p.Ping(ctx); return nil })
	return err
}

// Publish XADDs msgs[i] to the stream streams[i], in one pipeline, in claim
// (seq) order (on a cluster with MinReplicas, one pipeline per master, side
// by side), and returns each entry's id or error.
func (b *Broker) Publish(ctx context.Context, msgs []broker.Message, streams []string) ([]string, []error) {
	cmds := make([]*redis.StringCmd, len(msgs))
	spans := make([]trace.Span, len(msgs))
	unconfirmed := make([]error, len(msgs))
	if cc, ok := b.rdb.(*redis.ClusterClient); ok && b.cfg.MinReplicas > 0 {
		// WAIT counts the replicas that have the writes of its own
		// connection, on one node: pipeline each master's share on a
		// connection to that master, the masters side by side.
		var wg sync.WaitGroup
		for node, idx := range b.byMaster(ctx, cc, streams, unconfirmed) {
			wg.Go(func() { b.publishOn(ctx, node, idx, msgs, streams, cmds, spans, unconfirmed) })
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
	broker.EndSpans(spans, errs)
	if cc, ok := b.rdb.(*redis.ClusterClient); ok && slices.ContainsFunc(errs, movedSlot) {
		cc.ReloadState(ctx) // a slot moved under a master's own connection
	}
	return ids, errs
}

// byMaster groups the indexes of streams by the master node serving each
// stream's slot. An index whose master cannot be found gets its error in
// errs and no group.
func (b *Broker) byMaster(ctx context.Context, cc *redis.ClusterClient, streams []string, errs []error) map[Pipeliner][]int {
	groups := map[Pipeliner][]int{}
	nodes := map[string]*redis.Client{}
	for i, s := range streams {
		node, ok := nodes[s]
		if !ok {
			var err error
			if node, err = cc.MasterForKey(ctx, s); err != nil {
				errs[i] = fmt.Errorf("%w: find the master of %s: %w", broker.ErrUnavailable, s, err)
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
func (b *Broker) publishOn(ctx context.Context, rdb Pipeliner, idx []int, msgs []broker.Message, streams []string,
	cmds []*redis.StringCmd, spans []trace.Span, unconfirmed []error) {
	var wait *redis.Cmd
	_, _ = rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, i := range idx {
			m := msgs[i]
			// Continue the writer's trace; the entry carries this span on.
			var headers []byte
			headers, spans[i] = broker.StartSpan(ctx, m, streams[i], "redis")
			values := []any{
				entry.EventID, m.ID.String(),
				entry.EventType, m.EventType,
				entry.AggregateType, m.AggregateType,
				entry.AggregateID, m.AggregateID,
				entry.Payload, m.Payload,
				entry.Headers, headers,
				entry.OccurredAt, m.CreatedAt.UTC().Format(time.RFC3339Nano),
				entry.Seq, m.Seq,
				entry.PartitionKey, m.PartitionKey,
			}
			if attrs := b.cfg.CloudEvents.Attributes(m); attrs != nil {
				for _, a := range attrs {
					values = append(values, entry.CEFieldPrefix+a.Name, a.Value)
				}
				values = append(values, entry.ContentType, broker.ContentType)
			}
			cmds[i] = p.XAdd(ctx, &redis.XAddArgs{Stream: streams[i], Values: values})
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
		err = fmt.Errorf("%w: %w: %w", broker.ErrUnavailable, ErrNotReplicated, werr)
	} else if n < int64(b.cfg.MinReplicas) {
		err = fmt.Errorf("%w: %w: %d of %d replicas within %s", broker.ErrUnavailable, ErrNotReplicated, n, b.cfg.MinReplicas, b.cfg.ReplicaTimeout)
	}
	for _, i := range idx {
		unconfirmed[i] = err
	}
}
