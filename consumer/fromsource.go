package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer/source"
	"github.com/tedbank/outbox/internal/failpoint"
	"github.com/tedbank/outbox/internal/retry"
	"github.com/tedbank/outbox/relay/entry"
)

// Reading from a Source (NewWithSource) instead of Redis Streams: NATS
// JetStream's is package consumer/natssource. Each partition is read by its
// owner only; partition ownership, the consumer's name, dead letters and
// stats stay in Redis exactly as with Redis Streams, so the effects and
// their fences do not change.
//
// A new owner opens the partition on the source, which delivers whatever
// the previous owner received and did not acknowledge first, in stream
// order, before anything new (as the Redis path takes over the pending
// entries first). A message whose effect fails transiently is negatively
// acknowledged with the retry backoff, and the partition opened again; one
// that can never be applied is, at its MaxDeliveries-th delivery, added to
// the partition's dead-letter stream in Redis (with dlq_broker, the
// source's System) and terminated.

// NewWithSource returns a consumer that reads from src and applies with h;
// rdb holds its partition leases, its name's lease, its dead letters and
// stats. It checks cfg but does not connect. The single steps of the tests
// (internal/consumertest) are Redis Streams': Run is how it consumes.
func NewWithSource(rdb redis.Cmdable, src source.Source, h Handler, cfg Config) (*Consumer, error) {
	if src == nil {
		return nil, fmt.Errorf("%w: no source", ErrConfig)
	}
	c, err := New(rdb, h, cfg)
	if err != nil {
		return nil, err
	}
	c.src = src
	return c, nil
}

// errSingleStepsRedisOnly: the single steps read Redis Streams.
var errSingleStepsRedisOnly = errors.New("consumer: the single steps (read new, process pending, claim idle) read Redis Streams; a consumer of a source consumes with Run")

// workSource applies partition pt from the source while this consumer
// holds its lease with value fence, until ctx is cancelled or the lease
// turns out lost.
func (c *Consumer) workSource(ctx context.Context, pt part, fence string) {
	f := feed{part: pt, fence: fence}
	log := c.log.With(slog.Int("partition", pt.n))
	var rd source.Reader
	failures := 0
	for ctx.Err() == nil {
		var err error
		if rd != nil && !rd.Valid() {
			log.Info("connection to the source replaced; re-reading the partition from what is unacknowledged")
			rd = nil
		}
		if rd == nil {
			rd, err = c.openSource(ctx, f)
		} else {
			err = c.readSource(ctx, f, rd)
		}
		switch {
		case err == nil:
			failures = 0
		case ctx.Err() != nil:
		case errors.Is(err, ErrFenced):
			log.Error("partition lease lost while applying its events; stopping the partition", slog.Any("error", err))
			return
		default:
			// Open the partition again: what failed comes first, before
			// anything newer (the partition's order), as the Redis path
			// applies its pending entries first. (A message that keeps
			// failing is retried so, every round, with the ones after it:
			// skipped as duplicates.)
			if rd != nil {
				rd.Failed(err)
			}
			rd = nil
			failures++
			d := retryDelay(failures)
			log.Warn("reading the source failed; retrying", slog.Any("error", err), slog.Duration("retry_in", d))
			retry.Sleep(ctx, d)
		}
	}
}

// openSource opens f's partition on the source for its owner, after
// checking that the lease still holds f.fence.
func (c *Consumer) openSource(ctx context.Context, f feed) (source.Reader, error) {
	pt := f.part
	if v, err := c.rdb.Get(ctx, pt.keys.Lease(c.cfg.Group)).Result(); err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("check the partition lease before opening the partition: %w", err)
	} else if v != f.fence {
		return nil, fmt.Errorf("%w: partition %d's lease holds %q, not %q", ErrFenced, pt.n, v, f.fence)
	}
	epoch, err := leaseEpoch(f.fence)
	if err != nil {
		return nil, err
	}
	if err := c.checkStreamAge(ctx); err != nil {
		return nil, err
	}
	rd, err := c.src.Open(ctx, source.Partition{Group: c.cfg.Group, Subject: pt.stream, N: pt.n, Epoch: epoch, Owner: f.fence,
		AckWait: c.cfg.ClaimMinIdle, MaxAckPending: 4 * c.cfg.BatchSize})
	if err != nil {
		return nil, err
	}
	c.log.Info("partition opened on the source", slog.Int("partition", pt.n), slog.Any("reader", rd))
	return rd, nil
}

// checkStreamAge reports why the handler's dedupe records cannot cover a
// partition read again from the source's first message: the source keeps
// its messages longer than the records. A handler that does not say how
// long it keeps its records (Deduper) is not checked; nor is a consumer of
// Redis Streams.
func (c *Consumer) checkStreamAge(ctx context.Context) error {
	d, ok := c.handler.(Deduper)
	if c.src == nil || !ok || c.streamAgeChecked.Load() {
		return nil
	}
	checked, err := c.src.CheckRetention(ctx, c.parts[0].stream, d.DedupeTTL())
	if err != nil && checked {
		return fmt.Errorf("%w: %w", ErrConfig, err)
	}
	if err != nil {
		return err
	}
	c.streamAgeChecked.Store(checked)
	return nil
}

// leaseEpoch is the epoch of a partition lease value ("<epoch>|<holder>").
func leaseEpoch(fence string) (int64, error) {
	e, _, _ := strings.Cut(fence, "|")
	n, err := strconv.ParseInt(e, 10, 64)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("partition lease value %q has no epoch", fence)
	}
	return n, nil
}

// readSource applies up to a batch of f's messages.
func (c *Consumer) readSource(ctx context.Context, f feed, rd source.Reader) error {
	msgs, err := rd.Read(ctx, c.cfg.BatchSize, c.cfg.Block)
	if len(msgs) > 0 {
		if herr := c.handleSource(ctx, f, rd, msgs); herr != nil {
			return herr
		}
	}
	return err
}

// handleSource applies msgs and settles each as its outcome says. Once
// messages are read it finishes even if ctx is cancelled.
func (c *Consumer) handleSource(ctx context.Context, f feed, rd source.Reader, msgs []source.Message) error {
	ctx = context.WithoutCancel(ctx)
	started := time.Now()
	defer func() { c.cfg.Metrics.observeBatch(time.Since(started)) }()
	failpoint.Inject(c.afterRead)
	ds := make([]delivery, len(msgs))
	for i, m := range msgs {
		ds[i] = newDelivery(m.ID(), m.Values(), m.Deliveries())
	}
	done := c.apply(ctx, f, ds, c.src.System())
	settled := make([]bool, len(msgs))
	var ackErr error
	for _, i := range done.ack {
		settled[i] = true
		if err := msgs[i].Ack(); err != nil {
			ackErr = fmt.Errorf("ack message %s: %w", ds[i].id, err)
		}
	}
	for _, bad := range done.bad {
		settled[bad.index] = true
		c.invalidFromSource(ctx, f, bad, ds[bad.index].attempt, msgs[bad.index])
	}
	for i, ok := range settled {
		if !ok { // failed transiently: again after the backoff
			_ = msgs[i].Nak(retryDelay(int(ds[i].attempt)))
		}
	}
	if err := rd.Flush(c.cfg.Block); err != nil && ackErr == nil {
		ackErr = err
	}
	if done.transient != nil {
		return done.transient
	}
	return ackErr
}

// invalidFromSource handles a message that can never be applied: it is
// delivered again after the retry backoff until its MaxDeliveries-th
// delivery, then added to the partition's dead-letter stream in Redis and
// terminated.
func (c *Consumer) invalidFromSource(ctx context.Context, f feed, bad invalidEntry, deliveries int64, m source.Message) {
	log := c.log.With(slog.String("subject", m.Subject()), slog.String("sequence", bad.id), slog.Any("error", bad.err),
		slog.Int64("attempt", deliveries))
	if id, ok := bad.values[entry.EventID].(string); ok {
		log = log.With(slog.String("event_id", id))
	}
	c.stats.failed.Add(1)
	if deliveries < int64(c.cfg.MaxDeliveries) {
		log.Warn("invalid message delivered again until its last delivery", slog.Int("max_deliveries", c.cfg.MaxDeliveries))
		_ = m.Nak(retryDelay(int(deliveries)))
		return
	}
	fields := make([]any, 0, 2*len(bad.values)+14)
	for k, v := range bad.values {
		fields = append(fields, k, v)
	}
	fields = append(fields, "dlq_stream", m.Subject(), "dlq_group", c.cfg.Group, "dlq_entry_id", bad.id,
		"dlq_reason", bad.err.Error(), "dlq_deliveries", deliveries, "dlq_consumer", c.cfg.Consumer, "dlq_broker", c.src.System())
	_, err := c.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		p.XAdd(ctx, &redis.XAddArgs{Stream: f.keys.DeadLetters(), Values: fields})
		p.HIncrBy(ctx, f.keys.Stats(), "dead_lettered", 1)
		return nil
	})
	if err != nil {
		log.Error("dead-lettering failed; the message is delivered again", slog.Any("dlq_error", err))
		_ = m.Nak(retryDelay(int(deliveries)))
		return
	}
	if err := m.Term(); err != nil {
		log.Warn("terminating a dead-lettered message failed; it may be dead-lettered again", slog.Any("error", err))
	}
	c.stats.deadLettered.Add(1)
	c.cfg.Metrics.deadLetter()
	log.Error("message moved to the dead-letter stream", slog.String("dlq", f.keys.DeadLetters()))
}
