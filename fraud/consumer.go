// Package fraud is the anti-fraud service: a consumer group (package
// consumer) that reads transfer.settled events and applies a simple velocity
// rule to each.
//
// Delivery is at least once (a relay can publish an event twice, a consumer
// can die before XACK), so the effect of an event — its verdict, the sender's
// running totals, an alert for review verdicts — is applied together with a
// dedupe marker on the event id in one Lua script, and only then acknowledged.
// A crash anywhere leaves either no effect (the entry is redelivered and
// applied) or the effect and the marker (the redelivery is skipped). Anti-fraud
// is the package consumer's Redis path: reading, claiming, partition
// ownership, retries, dead letters and graceful stop are the package's.
//
// The code, one concept per file: consumer.go (the Consumer), handle.go (a
// batch's effects: decode, pipeline the scripts, read the verdicts),
// effect.go and effect.lua (the effect with its dedupe marker), event.go
// (decoding the event), observer.go, report.go, config.go and metrics.go.
package fraud

import (
	"fmt"
	"log/slog"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/consumer/source"
)

// Consumer is one member of the anti-fraud consumer group: a
// consumer.Consumer whose handler applies the velocity rule (Run,
// EnsureGroup, Ready and Stats are its).
type Consumer struct {
	*consumer.Consumer
	cfg Config
}

// Stats counts what a consumer did since it started.
type Stats = consumer.Stats

// ErrNameInUse: another running consumer of the group has this consumer's
// name (consumer.ErrNameInUse).
var ErrNameInUse = consumer.ErrNameInUse

// New returns a consumer reading with rdb. It checks cfg but does not connect.
func New(rdb redis.Cmdable, cfg Config) (*Consumer, error) {
	return newConsumer(rdb, cfg, func(h consumer.Handler, cc consumer.Config) (*consumer.Consumer, error) {
		return consumer.New(rdb, h, cc)
	})
}

// NewWithSource returns a consumer reading from src (NATS JetStream:
// natssource.New) instead of Redis Streams; its effects, leases and dead
// letters stay in rdb (consumer.NewWithSource).
func NewWithSource(rdb redis.Cmdable, src source.Source, cfg Config) (*Consumer, error) {
	return newConsumer(rdb, cfg, func(h consumer.Handler, cc consumer.Config) (*consumer.Consumer, error) {
		return consumer.NewWithSource(rdb, src, h, cc)
	})
}

// newConsumer checks cfg and makes the consumer of anti-fraud's effects
// with engine.
func newConsumer(rdb redis.Cmdable, cfg Config, engine func(consumer.Handler, consumer.Config) (*consumer.Consumer, error)) (*Consumer, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validateOwn(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	log := cfg.Logger.With(slog.String("consumer", cfg.Consumer), slog.String("group", cfg.Group))
	// consumer.New checks the group's settings (consumer.Config.Validate).
	c, err := engine(&effects{cfg: cfg, rdb: rdb, log: log}, cfg.Config)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	return &Consumer{Consumer: c, cfg: cfg}, nil
}

// Config returns the consumer's effective configuration.
func (c *Consumer) Config() Config { return c.cfg }
