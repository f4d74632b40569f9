// Package redisbroker publishes a relay's events to Redis Streams: an XADD
// per event, a batch in one pipeline, optionally confirmed by replicas. It
// trims the streams it published to (Maintain, which the relay runs) and
// refuses a Redis that evicts keys (Check, when the relay starts):
//
//	b, err := redisbroker.New(rdb, redisbroker.Config{})
//	...
//	r, err := relay.New(pool, b, relay.Config{})
package redisbroker

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
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

// Defaults for the zero fields of Config.
const (
	DefaultTrimInterval = 10 * time.Second
	// DefaultStreamRetention: entries that every consumer group has
	// acknowledged are trimmed once they are this old.
	DefaultStreamRetention = time.Hour
	// DefaultReplicaTimeout bounds the WAIT of Config.MinReplicas.
	DefaultReplicaTimeout = time.Second
)

// Config says how the broker confirms a publish and keeps its streams.
type Config struct {
	// MinReplicas: after each publish pipeline the broker waits (Redis WAIT,
	// on the pipeline's connection) until this many replicas have its
	// entries, ReplicaTimeout at most. Entries not confirmed are reported
	// ErrNotReplicated (the broker unavailable): the relay does not mark
	// them published but releases them for another try without spending an
	// attempt, and backs off as when Redis is down (a failover that promotes
	// a replica without them cannot lose a published event; consumers
	// dedupe the copies the retries add). 0, the default, does not wait. On
	// a Redis Cluster client the broker pipelines each master's share of a
	// batch on a connection to that master, and WAITs there.
	MinReplicas int
	// ReplicaTimeout bounds the WAIT (default DefaultReplicaTimeout); the
	// relay requires it shorter than its publish timeout.
	ReplicaTimeout time.Duration
	// CloudEvents adds each event's CloudEvents attributes to its entry
	// (entry.CEID, ...), after the fields it always has.
	CloudEvents broker.CloudEvents
	// StreamMaxLen and StreamRetention cap the streams the broker publishes
	// to: entries beyond the newest StreamMaxLen (0: no cap), or older than
	// StreamRetention, are trimmed every TrimInterval (default
	// DefaultTrimInterval) by Maintain — but never one that a consumer group
	// has not read or not acknowledged. When both are 0, StreamRetention is
	// DefaultStreamRetention: streams are trimmed by acknowledged position,
	// an hour behind. A negative StreamRetention keeps every entry (streams
	// grow without bound).
	StreamMaxLen    int64
	StreamRetention time.Duration
	TrimInterval    time.Duration
	// AllowEvictingRedis lets Check (and so relay.Run) pass a Redis whose
	// maxmemory-policy evicts keys (any but noeviction, on any node of a
	// Redis Cluster). The streams survive the volatile policies, but the
	// consumers' dedupe markers on the same Redis do not: a relay that
	// publishes an event again (killed between its XADD and its mark) then
	// has it take effect twice. By default such a Redis is refused
	// (ErrEvictingRedis), read from INFO, which managed services allow where
	// they forbid CONFIG.
	AllowEvictingRedis bool
	// Logger receives the trimmer's and the checks' logs. Default:
	// slog.Default().
	Logger *slog.Logger
	// Metrics, when set, counts the entries trimmed.
	Metrics *Metrics
}

// ErrNotReplicated: Redis took the entries, but fewer replicas than
// Config.MinReplicas confirmed them in time.
var ErrNotReplicated = errors.New("not confirmed by enough replicas")

// Broker publishes to Redis Streams.
type Broker struct {
	rdb     Pipeliner
	cfg     Config
	streams streamSet // published to, for Maintain
}

var (
	_ broker.Broker     = (*Broker)(nil)
	_ broker.Checker    = (*Broker)(nil)
	_ broker.Maintainer = (*Broker)(nil)
)

// New returns a broker publishing to rdb. It checks cfg but does not
// connect.
func New(rdb Pipeliner, cfg Config) (*Broker, error) {
	if cfg.StreamMaxLen == 0 && cfg.StreamRetention == 0 {
		cfg.StreamRetention = DefaultStreamRetention
	}
	cfg.TrimInterval = cmp.Or(cfg.TrimInterval, DefaultTrimInterval)
	cfg.ReplicaTimeout = cmp.Or(cfg.ReplicaTimeout, DefaultReplicaTimeout)
	cfg.Logger = cmp.Or(cfg.Logger, slog.Default())
	switch {
	case rdb == nil:
		return nil, errors.New("redisbroker: no Redis client")
	case cfg.MinReplicas < 0:
		return nil, fmt.Errorf("redisbroker: min replicas %d: must not be negative", cfg.MinReplicas)
	case cfg.MinReplicas > 0 && cfg.ReplicaTimeout < time.Millisecond:
		return nil, fmt.Errorf("redisbroker: replica timeout %s: must be at least 1ms", cfg.ReplicaTimeout)
	case cfg.StreamMaxLen < 0 || cfg.TrimInterval < 0:
		return nil, errors.New("redisbroker: stream max length and trim interval must not be negative")
	}
	if err := cfg.CloudEvents.Validate(); err != nil {
		return nil, fmt.Errorf("redisbroker: %w", err)
	}
	return &Broker{rdb: rdb, cfg: cfg}, nil
}

// ConfirmTimeout is how long a publish may wait for its replicas beyond the
// pipeline itself (0 without MinReplicas): the relay requires its publish
// timeout longer.
func (b *Broker) ConfirmTimeout() time.Duration {
	if b.cfg.MinReplicas == 0 {
		return 0
	}
	return b.cfg.ReplicaTimeout
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
	if b.trims() {
		b.streams.add(streams, errs)
	}
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
