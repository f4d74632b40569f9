package relay

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"regexp"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tedbank/outbox/partition"
)

// Defaults for the zero fields of Config.
const (
	DefaultBatchSize      = 500
	DefaultBatchBytes     = 16 << 20
	DefaultLease          = 30 * time.Second
	DefaultPollInterval   = 5 * time.Second
	DefaultPublishTimeout = 5 * time.Second
	DefaultMaxAttempts    = 10
	DefaultBackoffBase    = time.Second
	DefaultBackoffMax     = 5 * time.Minute
	DefaultStreamPrefix   = "outbox.event."
	DefaultChannel        = "outbox_messages"
	// DefaultBusyPace is 0.
	//
	// Deprecated: Config.BusyPace is ignored.
	DefaultBusyPace time.Duration = 0
	// DefaultBusyRows: a relay tells writers to stop notifying when its
	// claims find 8 rows within 20 ms, 400 commits a second and up
	// (relay/wakeup.go).
	DefaultBusyRows = 8
)

// MaxBatchSize bounds Config.BatchSize.
const MaxBatchSize = 10_000

var (
	channelPattern = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)
	streamPattern  = regexp.MustCompile(`^[A-Za-z0-9_.:{}-]{0,200}$`)
)

// Ownership values: how the relays of one database divide the outbox.
const (
	// OwnRows, the zero value's and the card's: each relay claims rows
	// (FOR UPDATE SKIP LOCKED, status publishing, a claim token per batch)
	// and the reaper returns claims whose lease ran out. Relays share every
	// partition key; a per-key probe in the claim keeps the order.
	OwnRows = "rows"
	// OwnPartitions: each relay leases its share of the partition-key slots
	// (sql/migrations/0010) and reads its slots' rows without claiming
	// them: one heap update per event instead of two, no probe. A relay
	// that dies loses its slots to the others once its LISTEN backend is
	// gone, one that stalls when its leases run out (Lease), and one that
	// stops gives them back at once. Every relay of a database must use the
	// same ownership.
	OwnPartitions = "partitions"
	// OwnAuto, the default of the outbox relay command: the ownership of
	// the relays already running on the database, chosen when Run starts
	// (Relay.Ownership says which); with none running, OwnRows while a row
	// claimer may still run unseen (registered and not known gone, as after
	// a PostgreSQL restart, or with a claim younger than Lease),
	// OwnPartitions otherwise. So a fleet of relays claiming rows keeps
	// claiming rows through a rolling upgrade (each new relay follows the
	// ones running), and comes up with partition leases once every relay
	// has stopped gracefully at the same time.
	OwnAuto = "auto"
)

// Config tunes a Relay. The zero value of every field means its default.
type Config struct {
	// Name identifies this relay in claimed_by and logs, and owns its
	// partition leases (OwnPartitions): a relay restarted under the same
	// name takes its predecessor's slots back at once, so names must be
	// unique among the relays running. Default: hostname-pid.
	Name string
	// BatchSize is how many rows one claim takes (and one pipeline publishes).
	BatchSize int
	// BatchBytes bounds a claim's payload bytes as well: of the rows a
	// claim finds, it takes the smallest first while the bytes before each
	// stay under BatchBytes (always at least one row), so that big payloads
	// bound the relay's memory and each publish by bytes, and do not hold
	// small events of other keys back. Default DefaultBatchBytes (16 MiB).
	BatchBytes int64
	// Ownership is OwnRows (default), OwnPartitions or OwnAuto. Every relay
	// of a database must run the same one: a relay that meets relays of the
	// other ownership stops with ErrMixedOwnership (OwnAuto follows them).
	Ownership string
	// Lease is how long a claim is valid. A row still publishing after the
	// lease (its relay died or stalled) is returned to pending by the reaper.
	// With OwnPartitions, it is also how long a partition slot's lease
	// lasts without renewal. Measured on the database clock.
	Lease time.Duration
	// PollInterval is the fallback poll: the relay drains at least this often
	// even without notifications, and pings its LISTEN connection when no
	// notification arrived for that long.
	PollInterval time.Duration
	// BusyPace is ignored: a busy relay claims again at once after a small
	// batch (docs/design.md, "The wake-up protocol's numbers", says why).
	//
	// Deprecated: pausing cost events latency and bought the writers
	// nothing measurable; leave it out.
	BusyPace time.Duration
	// BusyRows is how many rows the relay's claims must find within 20 ms,
	// in two claims or more, or one claim after the first of a drain (or a
	// full batch), for the relay to tell writers to stop notifying while it
	// drains (the "busy" state); it stays busy while its claims of the last
	// 20 ms find as many. Lower, a relay goes busy at a lower rate; each
	// commit may then wait a linger step (0.5 ms) for the next claim
	// instead of waking it, and each writer saves its NOTIFY. Default
	// DefaultBusyRows.
	BusyRows int
	// ReapInterval is how often the reaper looks for expired leases.
	// Default: Lease/2.
	ReapInterval time.Duration
	// PublishTimeout bounds one pipelined publish. Must be shorter than Lease.
	PublishTimeout time.Duration
	// MaxAttempts is how many failed attempts make a row dead.
	MaxAttempts int
	// Redelivery is how long after an event may first have reached the
	// broker (a publish not marked: the relay died, the reply timed out,
	// the replicas did not confirm) a relay may still publish it again:
	// after it the event goes dead instead, so a consumer whose dedupe
	// records outlive it (consumer.Config.RelayRedelivery) never applies it
	// twice. Default: RedeliveryWindow's formula (58 minutes).
	Redelivery time.Duration
	// BackoffBase and BackoffMax bound the exponential backoff (with jitter)
	// between attempts of one event.
	BackoffBase time.Duration
	BackoffMax  time.Duration
	// StreamPrefix makes the stream key <StreamPrefix><aggregate_type>, so all
	// events of one aggregate share a stream and keep their order.
	StreamPrefix string
	// Stream, when set, is the one stream every event goes to instead.
	Stream string
	// Partitions splits each stream into this many partition streams
	// (package partition): an event goes to partition.Of(its partition key)
	// and the stream partition.Stream(key, p, Partitions), which carries
	// a Redis Cluster hash tag. Relays and consumers of a deployment must
	// agree on it (docs/operations.md says how to change it). Default 1: one
	// stream under its plain name.
	Partitions int
	// Channel is the LISTEN channel the outbox trigger notifies.
	Channel string
	// ListenConfig is the connection used only for LISTEN. Default: the pool's
	// connection config with application_name "<pool application_name>-listen".
	ListenConfig *pgx.ConnConfig
	// Logger receives the relay's logs. Default: slog.Default().
	Logger *slog.Logger
	// Metrics, when set, records the relay's Prometheus metrics.
	Metrics *Metrics
	// Observer, when set, is told the event ids of each batch claimed and
	// published (observer.go).
	Observer Observer
}

// WithDefaults returns c with every zero field set to its default, as New
// runs it (Relay.Config returns the same).
func (c Config) WithDefaults() Config { return c.withDefaults() }

func (c Config) withDefaults() Config {
	if c.Name == "" {
		host, _ := os.Hostname()
		c.Name = fmt.Sprintf("%s-%d", host, os.Getpid())
	}
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	c.BatchBytes = cmp.Or(c.BatchBytes, DefaultBatchBytes)
	c.Ownership = cmp.Or(c.Ownership, OwnRows)
	c.Lease = cmp.Or(c.Lease, DefaultLease)
	c.PollInterval = cmp.Or(c.PollInterval, DefaultPollInterval)
	c.ReapInterval = cmp.Or(c.ReapInterval, c.Lease/2)
	c.PublishTimeout = cmp.Or(c.PublishTimeout, min(DefaultPublishTimeout, c.Lease/2))
	c.MaxAttempts = cmp.Or(c.MaxAttempts, DefaultMaxAttempts)
	c.BackoffBase = cmp.Or(c.BackoffBase, DefaultBackoffBase)
	c.BackoffMax = cmp.Or(c.BackoffMax, max(DefaultBackoffMax, c.BackoffBase))
	if c.StreamPrefix == "" && c.Stream == "" {
		c.StreamPrefix = DefaultStreamPrefix
	}
	c.Channel = cmp.Or(c.Channel, DefaultChannel)
	c.BusyRows = cmp.Or(c.BusyRows, DefaultBusyRows)
	c.Partitions = cmp.Or(c.Partitions, 1)
	c.Logger = cmp.Or(c.Logger, slog.Default())
	return c
}

// RedeliveryWindow is how long after an event may first have reached the
// broker a relay may publish it again (Redelivery): a bound, enforced in the
// claim and the partition read (migration 0011: first_sent_at) and by the
// reaper, which marks older ones dead. Its default leaves room for every one
// of the MaxAttempts attempts to follow within a lease, a reaper interval, a
// publish timeout and a backoff. A consumer's dedupe records must outlive it
// (consumer.Config.RelayRedelivery). An operator's retry of a dead event
// (outbox dead retry) publishes it again whenever it runs: knowingly.
func (c Config) RedeliveryWindow() time.Duration {
	c = c.withDefaults()
	if c.Redelivery > 0 {
		return c.Redelivery
	}
	return time.Duration(c.MaxAttempts) * (c.Lease + c.ReapInterval + c.PublishTimeout + c.BackoffMax)
}

// ErrConfig is wrapped by every error of Validate, and so of New for a
// Config that cannot work.
var ErrConfig = errors.New("relay config")

// Validate reports the first setting that cannot work, after defaults; the
// error wraps ErrConfig.
func (c Config) Validate() error {
	if err := c.withDefaults().validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrConfig, err)
	}
	return nil
}

func (c Config) validate() error {
	switch {
	case c.Ownership != OwnAuto && c.Ownership != OwnRows && c.Ownership != OwnPartitions:
		return fmt.Errorf("ownership %q: must be %q, %q or %q", c.Ownership, OwnRows, OwnPartitions, OwnAuto)
	case c.BatchSize < 1 || c.BatchSize > MaxBatchSize:
		return fmt.Errorf("batch size %d: must be between 1 and %d", c.BatchSize, MaxBatchSize)
	case c.BatchBytes < 1:
		return fmt.Errorf("batch bytes %d: must be at least 1", c.BatchBytes)
	case c.Lease < time.Millisecond:
		return fmt.Errorf("lease %s: must be at least 1ms", c.Lease)
	case c.PollInterval < time.Millisecond:
		return fmt.Errorf("poll interval %s: must be at least 1ms", c.PollInterval)
	case c.BusyRows < 1:
		return fmt.Errorf("busy rows %d: must be at least 1", c.BusyRows)
	case c.ReapInterval < time.Millisecond:
		return fmt.Errorf("reap interval %s: must be at least 1ms", c.ReapInterval)
	case c.PublishTimeout <= 0 || c.PublishTimeout >= c.Lease:
		return fmt.Errorf("publish timeout %s: must be positive and shorter than the lease (%s)", c.PublishTimeout, c.Lease)
	case c.MaxAttempts < 1:
		return fmt.Errorf("max attempts %d: must be at least 1", c.MaxAttempts)
	case c.Redelivery < 0 || (c.Redelivery > 0 && c.Redelivery <= c.Lease+c.ReapInterval):
		return fmt.Errorf("redelivery window %s: must be longer than the lease and a reaper interval (%s), or 0 for the default",
			c.Redelivery, c.Lease+c.ReapInterval)
	case c.BackoffBase <= 0 || c.BackoffMax < c.BackoffBase:
		return fmt.Errorf("backoff %s..%s: base must be positive and not above max", c.BackoffBase, c.BackoffMax)
	case !streamPattern.MatchString(c.StreamPrefix):
		return fmt.Errorf("stream prefix %q: must match %s", c.StreamPrefix, streamPattern)
	case !streamPattern.MatchString(c.Stream):
		return fmt.Errorf("stream %q: must match %s", c.Stream, streamPattern)
	case partition.Validate(c.Partitions) != nil:
		return partition.Validate(c.Partitions)
	case !channelPattern.MatchString(c.Channel):
		return fmt.Errorf("channel %q: must match %s", c.Channel, channelPattern)
	}
	return nil
}

// StreamKey returns the stream events of aggregateType are published to;
// with several partitions, the base of its partition streams.
func (c Config) StreamKey(aggregateType string) string {
	return c.withDefaults().baseStream(aggregateType)
}

// PartitionStream returns the stream an event of aggregateType with
// partitionKey is published to.
func (c Config) PartitionStream(aggregateType, partitionKey string) string {
	return c.withDefaults().streamKey(aggregateType, partitionKey)
}

// baseStream is StreamKey for a config that already has its defaults.
func (c Config) baseStream(aggregateType string) string {
	if c.Stream != "" {
		return c.Stream
	}
	return c.StreamPrefix + aggregateType
}

// streamKey is PartitionStream for a config that already has its defaults.
func (c Config) streamKey(aggregateType, partitionKey string) string {
	n := c.Partitions
	return partition.Stream(c.baseStream(aggregateType), partition.Of(partitionKey, n), n)
}
