package consumer

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"regexp"
	"time"

	"github.com/tedbank/outbox/partition"
)

// Defaults for the zero fields of Config.
const (
	DefaultBatchSize = 100
	// DefaultBacklogFactor: under a backlog a read asks for up to this many
	// times BatchSize (MaxBatchSize's default).
	DefaultBacklogFactor  = 5
	DefaultBlock          = 2 * time.Second
	DefaultClaimInterval  = 5 * time.Second
	DefaultClaimMinIdle   = 30 * time.Second
	DefaultMaxDeliveries  = 5
	DefaultPartitionLease = 10 * time.Second
	// DefaultRelayRedelivery bounds how long after an event's first
	// publication a relay with the default settings may publish it again
	// (relay.Config.RedeliveryWindow: 57.5 minutes; a test keeps the two in
	// step).
	DefaultRelayRedelivery = time.Hour
	// MaxRetryDelay is the longest a consumer waits before it retries a
	// delivery that failed (its backoff's cap): a retry is one round trip,
	// so a second apart costs nothing, and the effects refused while Redis
	// was out of memory are applied within about a second of its return
	// (docs/design.md).
	MaxRetryDelay = time.Second
)

var (
	namePattern = regexp.MustCompile(`^[A-Za-z0-9_.:{}-]{1,200}$`)
	// A Config.Name is part of metric names and fail points.
	kindPattern = regexp.MustCompile(`^[a-z][a-z0-9_]{0,39}$`)
)

// Config tunes a Consumer. The zero value of every field but Name and
// Stream means its default.
type Config struct {
	// Name says what the consumer is for ("fraud", "ledger"): its metrics
	// are outbox_<Name>_*, its spans <Name>.process, its fail points
	// <Name>.after-read and <Name>.after-effect. Lower case letters, digits
	// and underscores.
	Name string
	// Stream is the stream the relay publishes the events to (with
	// Partitions, the base name of the partitions' streams).
	Stream string
	// Group is the consumer group. Default: Name.
	Group string
	// Consumer is this consumer's name in the group; it must be stable
	// across restarts and unique among the running consumers. Default: the
	// hostname.
	Consumer string
	// KeyPrefix prefixes every key the consumer itself writes (leases,
	// members, the <prefix>dlq dead-letter stream, <prefix>stats). Default:
	// Name + ":".
	KeyPrefix string
	// BatchSize is how many new entries a read asks for while the consumer
	// keeps up. A read of new entries that comes back full (a backlog) makes
	// the next one ask for twice as many, up to MaxBatchSize, and one that
	// does not brings it back to BatchSize: under a backlog a batch's fixed
	// costs (a transaction's commit, the round trips) are spread over more
	// messages, while at a low rate nothing waits for a batch to fill.
	// Pending entries are retried and claimed BatchSize at a time.
	BatchSize int
	// MaxBatchSize is the most entries one read returns: the most messages
	// one Handle call gets. Default DefaultBacklogFactor × BatchSize (at most
	// 10,000); set it to BatchSize to keep every batch at BatchSize.
	MaxBatchSize int
	// Block is how long a read waits for new entries before it comes back
	// empty (the reader then adopts what others left pending, and reads
	// again). A stop does not wait for it: Redis Streams' reads wait in
	// slices of a quarter second, NATS's end with their context.
	Block time.Duration
	// ClaimInterval is how often entries idle for ClaimMinIdle (their
	// consumer died, or they keep failing) are claimed. ClaimMinIdle must
	// exceed the longest legitimate processing time.
	ClaimInterval time.Duration
	ClaimMinIdle  time.Duration
	// MaxDeliveries is how many deliveries a message the handler finds
	// invalid (ErrInvalid) gets before it is moved to the dead-letter stream.
	MaxDeliveries int
	// Partitions is how many partitions the relay splits the stream into
	// (relay.Config.Partitions; they must agree). The consumers of a group
	// divide the partitions among themselves, each partition handled by one
	// consumer at a time, in stream order (ownership.go). Default 1.
	Partitions int
	// PartitionLease is how long a consumer's hold on a partition lasts
	// without renewal (renewed every PartitionLease/4): a dead consumer's
	// partitions move to the others within it.
	PartitionLease time.Duration
	// RelayRedelivery is how long after an event's first publication the
	// relays feeding the stream may publish it again
	// (relay.Config.RedeliveryWindow). A handler's dedupe records must
	// outlive it: New checks (CheckDedupeWindow). Default
	// DefaultRelayRedelivery.
	RelayRedelivery time.Duration
	// AllowEvictingRedis lets Run start on a Redis whose maxmemory-policy
	// evicts keys (any but noeviction, on any node of a Redis Cluster): the
	// handler's dedupe records, if it keeps them in Redis, or the stream
	// itself can be evicted, and a redelivered event take effect twice. By
	// default Run refuses such a Redis (ErrEvictingRedis), read from INFO,
	// which managed services allow where they forbid CONFIG.
	AllowEvictingRedis bool
	// Logger receives the consumer's logs. Default: slog.Default().
	Logger *slog.Logger
	// Metrics, when set, records the consumer's Prometheus metrics.
	Metrics *Metrics
}

func (c Config) withDefaults() Config {
	c.Group = cmp.Or(c.Group, c.Name)
	if c.Consumer == "" {
		host, err := os.Hostname()
		if err != nil || host == "" {
			host = cmp.Or(c.Name, "consumer")
		}
		c.Consumer = host
	}
	c.KeyPrefix = cmp.Or(c.KeyPrefix, c.Name+":")
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	c.MaxBatchSize = cmp.Or(c.MaxBatchSize, min(DefaultBacklogFactor*c.BatchSize, max(c.BatchSize, 10_000)))
	c.Block = cmp.Or(c.Block, DefaultBlock)
	c.ClaimInterval = cmp.Or(c.ClaimInterval, DefaultClaimInterval)
	c.ClaimMinIdle = cmp.Or(c.ClaimMinIdle, DefaultClaimMinIdle)
	c.MaxDeliveries = cmp.Or(c.MaxDeliveries, DefaultMaxDeliveries)
	c.Partitions = cmp.Or(c.Partitions, 1)
	c.PartitionLease = cmp.Or(c.PartitionLease, DefaultPartitionLease)
	c.RelayRedelivery = cmp.Or(c.RelayRedelivery, DefaultRelayRedelivery)
	c.Logger = cmp.Or(c.Logger, slog.Default())
	return c
}

// ErrConfig is wrapped by every error of Validate, and so of New for a
// Config that cannot work.
var ErrConfig = errors.New("consumer config")

// Validate reports the first setting that cannot work, after defaults; the
// error wraps ErrConfig.
func (c Config) Validate() error {
	if err := c.withDefaults().validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrConfig, err)
	}
	return nil
}

func (c Config) validate() error {
	if !kindPattern.MatchString(c.Name) {
		return fmt.Errorf("name %q: must match %s (it names metrics and fail points)", c.Name, kindPattern)
	}
	for _, n := range []struct{ what, v string }{
		{"stream", c.Stream}, {"group", c.Group}, {"consumer", c.Consumer}, {"key prefix", c.KeyPrefix},
	} {
		if !namePattern.MatchString(n.v) {
			return fmt.Errorf("%s %q: must match %s", n.what, n.v, namePattern)
		}
	}
	switch {
	case c.BatchSize < 1 || c.BatchSize > 10_000:
		return fmt.Errorf("batch size %d: must be between 1 and 10000", c.BatchSize)
	case c.MaxBatchSize < c.BatchSize || c.MaxBatchSize > 10_000:
		return fmt.Errorf("max batch size %d: must be between the batch size %d and 10000", c.MaxBatchSize, c.BatchSize)
	case c.Block < time.Millisecond:
		return fmt.Errorf("block %s: must be at least 1ms (0 would block forever)", c.Block)
	case c.ClaimInterval <= 0 || c.ClaimMinIdle < time.Millisecond:
		return fmt.Errorf("claim interval %s / min idle %s: must be positive", c.ClaimInterval, c.ClaimMinIdle)
	case c.MaxDeliveries < 1:
		return fmt.Errorf("max deliveries %d: must be at least 1", c.MaxDeliveries)
	case partition.Validate(c.Partitions) != nil:
		return partition.Validate(c.Partitions)
	case c.PartitionLease < 4*time.Millisecond || c.PartitionLease <= c.Block:
		return fmt.Errorf("partition lease %s: must be longer than the block %s", c.PartitionLease, c.Block)
	case c.RelayRedelivery < 0:
		return fmt.Errorf("relay redelivery %s: must not be negative", c.RelayRedelivery)
	}
	return nil
}

// RedeliveryWindow is how long after its effect was applied a message can
// still be delivered again: by the relays (RelayRedelivery), or by this
// consumer's group (an entry whose acknowledgement was lost is claimed again
// after ClaimMinIdle, within a ClaimInterval, once the retry backoff lets
// it). A dedupe record (an inbox row, a marker key) must outlive it.
func (c Config) RedeliveryWindow() time.Duration {
	c = c.withDefaults()
	return c.RelayRedelivery + c.ClaimMinIdle + c.ClaimInterval + MaxRetryDelay
}

// CheckDedupeWindow reports why keeping dedupe records for ttl cannot make
// effects exactly-once: a message may be delivered again after its record
// is gone (RedeliveryWindow). New runs it for a handler that says how long
// it keeps its records (Deduper).
func (c Config) CheckDedupeWindow(ttl time.Duration) error {
	if need := c.RedeliveryWindow(); ttl <= need {
		return fmt.Errorf("%w: dedupe records kept %s, but a message can be delivered again up to %s after its effect "+
			"(the relays' redelivery window %s, and this consumer's claim min idle, claim interval and retry backoff): "+
			"keep them longer", ErrConfig, ttl, need, c.withDefaults().RelayRedelivery)
	}
	return nil
}
