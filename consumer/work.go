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

// One work loop for every source: Redis Streams' (streams.go, New) and
// another broker's (NewWithSource; NATS JetStream's is package
// consumer/natssource). Each partition is read by its owner only; partition
// ownership, the consumer's name, dead letters and stats stay in Redis
// whatever the source, so the effects and their fences do not change.
//
// The owner opens the partition on the source, which delivers whatever an
// earlier owner received and did not acknowledge first, in stream order,
// before anything new; reads; applies each message's effect through the
// handler; and settles each one: acknowledged, negatively acknowledged for a
// retry, or, once it can never be applied and has had its MaxDeliveries-th
// delivery, moved to the partition's dead-letter stream in Redis and
// terminated. After a failure a reader that cannot go on in order (Valid)
// is opened again: what failed comes first.

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

// feed is a partition as one of its workers applies it: fence is the lease
// value the effects must find (empty: applied without ownership, by the
// single steps); gate keeps each key's order across reads (order.go) when
// the source's reader keeps one (Redis Streams'; another source reads a
// partition again from what is unacknowledged after any failure).
type feed struct {
	part
	fence string
	gate  *gate
}

// resumer is a reader that can go on after a failure, and says whether the
// consumer waits out its backoff first (streams.go).
type resumer interface {
	resume(ctx context.Context, log *slog.Logger, err error) (wait bool)
}

// work applies partition pt while this consumer holds its lease with value
// fence, until ctx is cancelled or the lease turns out lost.
func (c *Consumer) work(ctx context.Context, pt part, fence string) {
	f := feed{part: pt, fence: fence}
	log := c.log.With(slog.Int("partition", pt.n))
	var rd source.Reader
	defer func() { closeReader(rd) }()
	failures := 0
	for ctx.Err() == nil {
		var err error
		if rd != nil && !rd.Valid() {
			log.Info("connection to the source replaced; re-reading the partition from what is unacknowledged")
			closeReader(rd)
			rd = nil
		}
		if rd == nil {
			if rd, err = c.open(ctx, f); err == nil {
				f.gate = nil
				if g, ok := rd.(*streamReader); ok {
					f.gate = g.gate
				}
			}
		} else {
			err = c.read(ctx, f, rd)
		}
		switch {
		case err == nil:
			failures = 0
		case ctx.Err() != nil:
		case errors.Is(err, ErrFenced):
			log.Error("partition lease lost while applying its events; stopping the partition", slog.Any("error", err))
			return
		default:
			wait := true
			if r, ok := rd.(resumer); ok {
				wait = r.resume(ctx, log, err)
			} else if rd != nil {
				// Open the partition again: what failed comes first,
				// before anything newer (the partition's order). (A
				// message that keeps failing is retried so, every
				// round, with the ones after it: skipped as
				// duplicates.)
				rd.Failed(err)
				closeReader(rd)
				rd = nil
			}
			if !wait {
				failures = 0 // the reader paces what failed: the next read is new work
				continue
			}
			failures++
			d := retryDelay(failures)
			log.Warn("processing failed; retrying", slog.Any("error", err), slog.Duration("retry_in", d))
			retry.Sleep(ctx, d)
		}
	}
}

// closeReader waits for what a reader still has under way.
func closeReader(rd source.Reader) {
	if r, ok := rd.(interface{ close() }); ok {
		r.close()
	}
}

// open opens f's partition on the source for its owner, after checking that
// the lease still holds f.fence.
func (c *Consumer) open(ctx context.Context, f feed) (source.Reader, error) {
	pt := f.part
	if err := c.group.holds(ctx, pt, f.fence); err != nil {
		return nil, err
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
	c.log.Debug("partition opened on the source", slog.Int("partition", pt.n), slog.Any("reader", rd))
	return rd, nil
}

// checkStreamAge reports why the handler's dedupe records cannot cover a
// partition read again from the source's first message: the source keeps
// its messages longer than the records. A handler that does not say how
// long it keeps its records (Deduper) is not checked.
func (c *Consumer) checkStreamAge(ctx context.Context) error {
	d, ok := c.handler.(Deduper)
	if !ok || c.streamAgeChecked.Load() {
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

// read applies up to a batch of f's messages.
func (c *Consumer) read(ctx context.Context, f feed, rd source.Reader) error {
	c.reading.Send(f.part.n)
	msgs, err := rd.Read(ctx, c.cfg.BatchSize, c.cfg.Block)
	if len(msgs) > 0 {
		if herr := c.handle(ctx, f, rd, msgs); herr != nil {
			return herr
		}
	}
	return err
}

// handle applies msgs and settles each as its outcome says. Once messages
// are read it finishes even if ctx is cancelled. An error wrapping errEffect
// says that every message was handled and some effects failed (they are
// retried); any other, that the reader or the broker failed.
func (c *Consumer) handle(ctx context.Context, f feed, rd source.Reader, msgs []source.Message) error {
	if len(msgs) == 0 {
		return nil
	}
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
		c.invalid(ctx, f, bad, msgs[bad.index])
	}
	for i, ok := range settled {
		if !ok { // failed transiently, or held: again after the backoff
			_ = msgs[i].Nak(retryDelay(int(ds[i].attempt)))
		}
	}
	if err := rd.Flush(c.cfg.Block); err != nil && ackErr == nil {
		ackErr = err
	}
	if ackErr != nil {
		return ackErr
	}
	if done.transient != nil {
		return fmt.Errorf("%w: %w", errEffect, done.transient)
	}
	return nil
}

// errEffect wraps the error of a read whose messages were all handled, some
// left pending by a transient failure of their effect (as opposed to a
// broker error that stopped the read): a pass over pending entries goes on
// past it, as the gate holds back the failed keys' later entries.
var errEffect = errors.New("effect failed")

// effectFailedOnly reports whether err is only effects that failed (and
// will be retried), not a lost partition nor a broker's error.
func effectFailedOnly(err error) bool {
	return errors.Is(err, errEffect) && !errors.Is(err, ErrFenced)
}

// deadLetterer is a message its source moves to the dead-letter stream
// itself, atomically with its acknowledgement (Redis Streams').
type deadLetterer interface {
	deadLetter(ctx context.Context, c *Consumer, f feed, reason string, deliveries int64) (moved bool, err error)
}

// invalid handles a message that can never be applied: it is delivered
// again until its MaxDeliveries-th delivery, then added to the partition's
// dead-letter stream in Redis, with the original fields (so it can be
// re-added to the source stream as is) and dlq_* fields that say why, and
// settled for good.
func (c *Consumer) invalid(ctx context.Context, f feed, bad invalidEntry, m source.Message) {
	deliveries := m.Deliveries()
	log := c.log.With(slog.String("subject", m.Subject()), slog.String("entry_id", bad.id), slog.Any("error", bad.err),
		slog.Int64("attempt", deliveries))
	for _, field := range []string{entry.EventID, entry.EventType, entry.AggregateID} {
		if v, ok := bad.values[field].(string); ok {
			log = log.With(slog.String(field, v))
		}
	}
	c.stats.failed.Add(1)
	if deliveries < int64(c.cfg.MaxDeliveries) {
		log.Warn("invalid message delivered again until its last delivery", slog.Int("max_deliveries", c.cfg.MaxDeliveries))
		_ = m.Nak(retryDelay(int(deliveries)))
		return
	}
	var moved bool
	var err error
	if d, ok := m.(deadLetterer); ok {
		moved, err = d.deadLetter(ctx, c, f, bad.err.Error(), deliveries)
	} else {
		moved, err = c.deadLetter(ctx, f, bad, m)
	}
	if err != nil {
		log.Error("dead-lettering failed; the message is delivered again", slog.Any("dlq_error", err))
		_ = m.Nak(retryDelay(int(deliveries)))
		return
	}
	if moved {
		c.stats.deadLettered.Add(1)
		c.cfg.Metrics.deadLetter()
		log.Error("message moved to the dead-letter stream", slog.String("dlq", f.keys.DeadLetters()))
	}
}

// deadLetter adds a message of another source than Redis Streams to the
// partition's dead-letter stream, with dlq_broker its source's System, and
// terminates it. A process stopping between the two dead-letters it again
// at its next delivery.
func (c *Consumer) deadLetter(ctx context.Context, f feed, bad invalidEntry, m source.Message) (bool, error) {
	fields := make([]any, 0, 2*len(bad.values)+14)
	for k, v := range bad.values {
		fields = append(fields, k, v)
	}
	fields = append(fields, "dlq_stream", m.Subject(), "dlq_group", c.cfg.Group, "dlq_entry_id", bad.id,
		"dlq_reason", bad.err.Error(), "dlq_deliveries", m.Deliveries(), "dlq_consumer", c.cfg.Consumer, "dlq_broker", c.src.System())
	if err := c.group.deadLetter(ctx, f.part, fields); err != nil {
		return false, err
	}
	if err := m.Term(); err != nil {
		c.log.Warn("terminating a dead-lettered message failed; it may be dead-lettered again", slog.Any("error", err))
	}
	return true, nil
}

// retryDelay backs off to MaxRetryDelay: a consumer failing on every entry
// must not spin.
func retryDelay(failures int) time.Duration {
	return retry.Backoff(failures, 100*time.Millisecond, MaxRetryDelay)
}
