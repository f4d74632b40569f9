package consumer

import (
	"context"
	_ "embed"
	"log/slog"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/relay/entry"
)

// deadLetterScript moves an entry to the dead-letter stream and acknowledges it.
var (
	//go:embed deadletter.lua
	deadLetterSrc    string
	deadLetterScript = redis.NewScript(deadLetterSrc)
)

// invalid handles an entry that can never be processed: it stays pending (it
// is redelivered by the claim of idle entries) until it has been delivered MaxDeliveries
// times, then it moves to the dead-letter stream.
func (c *Consumer) invalid(ctx context.Context, f feed, m invalidEntry) {
	log := c.log.With(slog.String("entry_id", m.id), slog.Any("error", m.err))
	if id, ok := m.values[entry.EventID].(string); ok {
		log = log.With(slog.String("event_id", id))
	}
	if t, ok := m.values[entry.EventType].(string); ok {
		log = log.With(slog.String("event_type", t))
	}
	if a, ok := m.values[entry.AggregateID].(string); ok {
		log = log.With(slog.String("aggregate_id", a))
	}
	c.stats.failed.Add(1)
	pend, err := c.rdb.XPendingExt(ctx, &redis.XPendingExtArgs{
		Stream: f.stream, Group: c.cfg.Group, Start: m.id, End: m.id, Count: 1,
	}).Result()
	if err != nil || len(pend) == 0 {
		log.Warn("invalid entry stays pending", slog.Any("xpending_error", err))
		return
	}
	deliveries := pend[0].RetryCount
	log = log.With(slog.Int64("attempt", deliveries))
	if deliveries < int64(c.cfg.MaxDeliveries) {
		log.Warn("invalid entry stays pending until its last delivery", slog.Int("max_deliveries", c.cfg.MaxDeliveries))
		return
	}
	moved, err := deadLetterScript.Run(ctx, c.rdb,
		[]string{f.stream, f.keys.DeadLetters(), f.keys.Stats()},
		c.cfg.Group, m.id, m.err.Error(), deliveries, c.cfg.Consumer).Int()
	if err != nil {
		log.Error("dead-lettering failed; entry stays pending", slog.Any("dlq_error", err))
		return
	}
	if moved == 1 {
		c.stats.deadLettered.Add(1)
		c.cfg.Metrics.deadLetter()
		log.Error("entry moved to the dead-letter stream", slog.String("dlq", f.keys.DeadLetters()))
	}
}
