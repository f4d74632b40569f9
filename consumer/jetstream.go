package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/failpoint"
	"github.com/tedbank/outbox/internal/natsjs"
	"github.com/tedbank/outbox/internal/retry"
	"github.com/tedbank/outbox/relay/entry"
)

// Reading from NATS JetStream (NewJetStream). The relay publishes each event
// to the subject its Redis stream would be named (Config.Stream, with the
// partition's suffix), its fields as headers. Each partition is read through
// a durable pull consumer of its own (the group's name and the partition's
// number), with explicit acknowledgements, by the partition's owner only:
// partition ownership, the consumer's name, dead letters and stats stay in
// Redis exactly as with Redis Streams, so the effects and their fences do
// not change.
//
// A new owner re-creates the partition's durable from its ack floor, so that
// whatever the previous owner received and did not acknowledge is delivered
// again first, in stream order, before anything new (as the Redis path takes
// over the pending entries first). A message whose effect fails transiently
// is negatively acknowledged with the retry backoff; one that can never be
// applied is, at its MaxDeliveries-th delivery, added to the partition's
// dead-letter stream in Redis (with dlq_broker=nats) and terminated.

// NewJetStream returns a consumer that reads from NATS JetStream (js) and
// applies with h; rdb holds its partition leases, its name's lease, its dead
// letters and stats. It checks cfg but does not connect. The single steps
// of the tests (stepReadNew, stepProcessPending, stepClaimIdle) are Redis
// Streams': Run is how it consumes.
func NewJetStream(rdb redis.Cmdable, js jetstream.JetStream, h Handler, cfg Config) (*Consumer, error) {
	if js == nil {
		return nil, fmt.Errorf("%w: no JetStream context", ErrConfig)
	}
	c, err := New(rdb, h, cfg)
	if err != nil {
		return nil, err
	}
	c.js = js
	return c, nil
}

// errSingleStepsRedisOnly: the single steps read Redis Streams.
var errSingleStepsRedisOnly = errors.New("consumer: the single steps (read new, process pending, claim idle) read Redis Streams; a JetStream consumer consumes with Run")

// DurableName is the base name of the JetStream durable consumers through
// which group reads partition p: the group's name (its dots, which a
// consumer name cannot have, as underscores) and "_p<p>". Each owner of the
// partition reads through a durable of its own, the base name and
// "_e<lease epoch>" (DurableNameOf): a partition's new owner creates its
// durable from the previous one's ack floor and deletes the older ones, so
// an owner that lost its lease and has not noticed yet fetches nothing of
// the new owner's (with one durable name for all, it fetched from the
// re-created durable, and what it fetched waited out its ack wait while the
// new owner applied the messages after it). Durable finds the current one.
func DurableName(group string, p int) string {
	return strings.NewReplacer(".", "_", "*", "_", ">", "_").Replace(group) + "_p" + strconv.Itoa(p)
}

// DurableNameOf is the name of the durable through which the owner of
// partition p of group with lease epoch epoch reads it.
func DurableNameOf(group string, p int, epoch int64) string {
	return DurableName(group, p) + "_e" + strconv.FormatInt(epoch, 10)
}

// durables lists partition p's durables of group on stream, by name, with
// the epoch of the owner each belongs to (0: the base name, from before
// owners had durables of their own).
func durables(ctx context.Context, js jetstream.JetStream, stream, group string, p int) (map[string]int64, error) {
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, fmt.Errorf("read JetStream stream %s: %w", stream, err)
	}
	base := DurableName(group, p)
	found := map[string]int64{}
	names := s.ConsumerNames(ctx)
	for name := range names.Name() {
		if name == base {
			found[name] = 0
			continue
		}
		rest, ok := strings.CutPrefix(name, base+"_e")
		if !ok {
			continue
		}
		if e, err := strconv.ParseInt(rest, 10, 64); err == nil && e > 0 {
			found[name] = e
		}
	}
	if err := names.Err(); err != nil {
		return nil, fmt.Errorf("list the durable consumers of %s: %w", stream, err)
	}
	return found, nil
}

// Durable returns the durable consumer through which group reads
// partition p on stream now: its current owner's (the greatest epoch). The
// error wraps jetstream.ErrConsumerNotFound when the partition has none yet.
func Durable(ctx context.Context, js jetstream.JetStream, stream, group string, p int) (jetstream.Consumer, error) {
	ds, err := durables(ctx, js, stream, group, p)
	if err != nil {
		return nil, err
	}
	newest, epoch := "", int64(-1)
	for name, e := range ds {
		if e > epoch {
			newest, epoch = name, e
		}
	}
	if newest == "" {
		return nil, fmt.Errorf("partition %d of group %s on %s: %w", p, group, stream, jetstream.ErrConsumerNotFound)
	}
	return js.Consumer(ctx, stream, newest)
}

// workJetStream applies partition pt from JetStream while this consumer
// holds its lease with value fence, until ctx is cancelled or the lease
// turns out lost.
func (c *Consumer) workJetStream(ctx context.Context, pt part, fence string) {
	f := feed{part: pt, fence: fence}
	log := c.log.With(slog.Int("partition", pt.n))
	var cons jetstream.Consumer
	var reconnects uint64 // the connection's reconnects when cons was taken over
	failures := 0
	for ctx.Err() == nil {
		var err error
		if n := c.js.Conn().Stats().Reconnects; cons != nil && n != reconnects {
			// Messages the server sent into the lost connection wait out
			// their ack wait before they come again, and newer ones would
			// overtake them: take the partition over again, from its ack
			// floor, as after a crash.
			log.Info("NATS connection replaced; re-reading the partition from its ack floor")
			cons = nil
		}
		if cons == nil {
			reconnects = c.js.Conn().Stats().Reconnects
			cons, err = c.takeOverJetStream(ctx, f)
		} else {
			err = c.readJetStream(ctx, f, cons)
		}
		switch {
		case err == nil:
			failures = 0
		case ctx.Err() != nil:
		case errors.Is(err, ErrFenced):
			log.Error("partition lease lost while applying its events; stopping the partition", slog.Any("error", err))
			return
		default:
			// Read the partition again from its ack floor: what failed
			// comes first, before anything newer (the partition's order),
			// as the Redis path applies its pending entries first. (A
			// message that keeps failing is retried so, every round, with
			// the ones after it: skipped as duplicates.)
			cons = nil
			if natsjs.Stale(err) {
				_ = c.js.Conn().ForceReconnect() // half-open? a new connection for the retry
			}
			failures++
			d := retryDelay(failures)
			log.Warn("reading JetStream failed; retrying", slog.Any("error", err), slog.Duration("retry_in", d))
			retry.Sleep(ctx, d)
		}
	}
}

// takeOverJetStream creates the durable consumer of f's owner (its lease
// epoch's) from the ack floor of the newest durable before it, and deletes
// the older ones, so that what an earlier owner received and did not
// acknowledge comes first, in stream order, and an earlier owner still
// fetching reads nothing more. It first checks that the lease still holds
// f.fence; a durable of a greater epoch (a newer owner's) fences it too.
func (c *Consumer) takeOverJetStream(ctx context.Context, f feed) (jetstream.Consumer, error) {
	pt := f.part
	if v, err := c.rdb.Get(ctx, pt.keys.Lease(c.cfg.Group)).Result(); err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("check the partition lease before taking its durable over: %w", err)
	} else if v != f.fence {
		return nil, fmt.Errorf("%w: partition %d's lease holds %q, not %q", ErrFenced, pt.n, v, f.fence)
	}
	epoch, err := leaseEpoch(f.fence)
	if err != nil {
		return nil, err
	}
	stream, err := c.js.StreamNameBySubject(ctx, pt.stream)
	if err != nil {
		return nil, fmt.Errorf("find the JetStream stream of subject %s (the relay creates it when it starts): %w", pt.stream, err)
	}
	if err := c.checkStreamAge(ctx); err != nil {
		return nil, err
	}
	ds, err := durables(ctx, c.js, stream, c.cfg.Group, pt.n)
	if err != nil {
		return nil, err
	}
	name := DurableNameOf(c.cfg.Group, pt.n, epoch)
	cc := jetstream.ConsumerConfig{
		Durable: name, Description: "outbox consumer group " + c.cfg.Group + ", partition " + strconv.Itoa(pt.n) + ", owner " + f.fence,
		FilterSubject: pt.stream, AckPolicy: jetstream.AckExplicitPolicy, AckWait: c.cfg.ClaimMinIdle,
		MaxAckPending: 4 * c.cfg.BatchSize, DeliverPolicy: jetstream.DeliverAllPolicy,
	}
	newest := int64(-1)
	for old, e := range ds {
		if e > epoch {
			return nil, fmt.Errorf("%w: partition %d has a newer owner's durable %s", ErrFenced, pt.n, old)
		}
		info, err := c.js.Consumer(ctx, stream, old)
		if errors.Is(err, jetstream.ErrConsumerNotFound) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("read the durable consumer %s: %w", old, err)
		}
		if floor := info.CachedInfo().AckFloor.Stream; e > newest && floor > 0 {
			cc.DeliverPolicy, cc.OptStartSeq = jetstream.DeliverByStartSequencePolicy, floor+1
		} else if e > newest {
			cc.DeliverPolicy, cc.OptStartSeq = jetstream.DeliverAllPolicy, 0
		}
		newest = max(newest, e)
	}
	for old := range ds {
		if err := c.js.DeleteConsumer(ctx, stream, old); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
			return nil, fmt.Errorf("delete the earlier durable consumer %s: %w", old, err)
		}
	}
	cons, err := c.js.CreateOrUpdateConsumer(ctx, stream, cc)
	if err != nil {
		return nil, fmt.Errorf("create the durable consumer %s on %s: %w", name, stream, err)
	}
	c.log.Info("partition's JetStream consumer taken over", slog.Int("partition", pt.n), slog.String("durable", name),
		slog.Uint64("from_sequence", max(cc.OptStartSeq, 1)))
	return cons, nil
}

// checkStreamAge reports why the handler's dedupe records cannot cover a
// partition read again from the stream's first message (its durables gone:
// deleted by hand, or never created): they must outlive the stream's
// messages (its MaxAge, --nats-max-age), or an effect older than its record
// is applied again. A handler that does not say how long it keeps its
// records (Deduper) is not checked; nor is a consumer of Redis Streams.
func (c *Consumer) checkStreamAge(ctx context.Context) error {
	d, ok := c.handler.(Deduper)
	if c.js == nil || !ok || c.streamAgeChecked.Load() {
		return nil
	}
	name, err := c.js.StreamNameBySubject(ctx, c.parts[0].stream)
	if err != nil {
		return fmt.Errorf("find the JetStream stream of subject %s: %w", c.parts[0].stream, err)
	}
	s, err := c.js.Stream(ctx, name)
	if err != nil {
		return fmt.Errorf("read JetStream stream %s: %w", name, err)
	}
	switch age, ttl := s.CachedInfo().Config.MaxAge, d.DedupeTTL(); {
	case age == 0:
		return fmt.Errorf("%w: JetStream stream %s keeps messages forever, but dedupe records are kept %s: "+
			"a partition read again from its first message would apply older effects twice; give the stream a max age "+
			"(relay --nats-max-age) no longer than the records", ErrConfig, name, ttl)
	case ttl < age:
		return fmt.Errorf("%w: JetStream stream %s keeps messages %s, longer than the dedupe records (%s): "+
			"a partition read again from its first message would apply older effects twice; keep the records at least as long",
			ErrConfig, name, age, ttl)
	}
	c.streamAgeChecked.Store(true)
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

// readJetStream applies up to a batch of pt's messages: those waiting now,
// or, when none is, the first to arrive within Config.Block with those that
// came with it. (A Fetch of a whole batch would wait out the Block whenever
// fewer are waiting: every event's latency would include it.)
func (c *Consumer) readJetStream(ctx context.Context, f feed, cons jetstream.Consumer) error {
	limit := c.cfg.Block + fetchGrace
	msgs, err := collect(ctx, limit)(cons.FetchNoWait(c.cfg.BatchSize))
	if err == nil && len(msgs) == 0 {
		started := time.Now()
		if msgs, err = collect(ctx, limit)(cons.Fetch(1, jetstream.FetchMaxWait(c.cfg.Block))); err == nil && len(msgs) == 1 && c.cfg.BatchSize > 1 {
			var more []jetstream.Msg
			more, err = collect(ctx, limit)(cons.FetchNoWait(c.cfg.BatchSize - 1))
			msgs = append(msgs, more...)
		}
		if err == nil && len(msgs) == 0 && time.Since(started) >= c.cfg.Block*3/2 && ctx.Err() == nil {
			// The server ends an expired pull request at its expiry; only
			// the client's own timer, later, ended this one: the
			// connection is silent (half-open).
			err = errSilent
		}
	}
	if len(msgs) > 0 {
		return c.handleJetStream(ctx, f, msgs)
	}
	return err
}

// fetchGrace is how much longer than its own wait a fetch may take before
// it is given up (its connection went silent, and the client library did
// not notice).
const fetchGrace = 5 * time.Second

// errSilent: a fetch ended by the client's timer, not the server's answer.
var errSilent = fmt.Errorf("no answer from the server to a pull request (half-open connection?): %w", nats.ErrTimeout)

// errFetchHung: a fetch did not end within its wait and fetchGrace.
var errFetchHung = fmt.Errorf("fetch did not end in time: %w", nats.ErrTimeout)

// collect returns a function that reads a fetch's messages, giving up after
// limit; running out of time or of messages is not an error. Messages that
// arrive after it gave up are delivered again after their ack wait.
func collect(ctx context.Context, limit time.Duration) func(jetstream.MessageBatch, error) ([]jetstream.Msg, error) {
	return func(batch jetstream.MessageBatch, err error) ([]jetstream.Msg, error) {
		if err != nil {
			return nil, fmt.Errorf("fetch: %w", err)
		}
		timer := time.NewTimer(limit)
		defer timer.Stop()
		var msgs []jetstream.Msg
		for {
			select {
			case m, ok := <-batch.Messages():
				if ok {
					msgs = append(msgs, m)
					continue
				}
			case <-timer.C:
				return msgs, errFetchHung
			case <-ctx.Done():
				return msgs, ctx.Err()
			}
			break
		}
		if err := batch.Error(); err != nil && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, nats.ErrTimeout) &&
			!errors.Is(err, jetstream.ErrNoMessages) {
			return msgs, fmt.Errorf("fetch: %w", err)
		}
		return msgs, nil
	}
}

// handleJetStream applies msgs and acknowledges each as its outcome says.
// Once messages are read it finishes even if ctx is cancelled.
func (c *Consumer) handleJetStream(ctx context.Context, f feed, msgs []jetstream.Msg) error {
	ctx = context.WithoutCancel(ctx)
	started := time.Now()
	defer func() { c.cfg.Metrics.observeBatch(time.Since(started)) }()
	failpoint.Inject(c.afterRead)
	ds := make([]delivery, len(msgs))
	for i, m := range msgs {
		values := map[string]any{entry.Payload: string(m.Data())}
		for k, v := range m.Headers() {
			if len(v) > 0 {
				values[k] = v[0]
			}
		}
		ds[i] = newDelivery("", values, 1)
		if meta, err := m.Metadata(); err == nil {
			ds[i].id = strconv.FormatUint(meta.Sequence.Stream, 10)
			ds[i].attempt = int64(meta.NumDelivered)
		}
	}
	done := c.apply(ctx, f, ds, "nats")
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
		c.invalidJetStream(ctx, f, bad, ds[bad.index].attempt, msgs[bad.index])
	}
	for i, ok := range settled {
		if !ok { // failed transiently: again after the backoff
			_ = msgs[i].NakWithDelay(retryDelay(int(ds[i].attempt)))
		}
	}
	// The acknowledgements are fire-and-forget: make sure they left (a
	// process stopping right after would lose them, and the messages would
	// come again, as duplicates).
	if err := c.js.Conn().FlushTimeout(c.cfg.Block); err != nil && ackErr == nil {
		ackErr = fmt.Errorf("flush the acknowledgements: %w", err)
	}
	if done.transient != nil {
		return done.transient
	}
	return ackErr
}

// invalidJetStream handles a message that can never be applied: it is
// delivered again after the retry backoff until its MaxDeliveries-th
// delivery, then added to the partition's dead-letter stream in Redis and
// terminated.
func (c *Consumer) invalidJetStream(ctx context.Context, f feed, bad invalidEntry, deliveries int64, m jetstream.Msg) {
	log := c.log.With(slog.String("subject", m.Subject()), slog.String("sequence", bad.id), slog.Any("error", bad.err),
		slog.Int64("attempt", deliveries))
	if id, ok := bad.values[entry.EventID].(string); ok {
		log = log.With(slog.String("event_id", id))
	}
	c.stats.failed.Add(1)
	if deliveries < int64(c.cfg.MaxDeliveries) {
		log.Warn("invalid message delivered again until its last delivery", slog.Int("max_deliveries", c.cfg.MaxDeliveries))
		_ = m.NakWithDelay(retryDelay(int(deliveries)))
		return
	}
	fields := make([]any, 0, 2*len(bad.values)+14)
	for k, v := range bad.values {
		fields = append(fields, k, v)
	}
	fields = append(fields, "dlq_stream", m.Subject(), "dlq_group", c.cfg.Group, "dlq_entry_id", bad.id,
		"dlq_reason", bad.err.Error(), "dlq_deliveries", deliveries, "dlq_consumer", c.cfg.Consumer, "dlq_broker", "nats")
	_, err := c.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		p.XAdd(ctx, &redis.XAddArgs{Stream: f.keys.DeadLetters(), Values: fields})
		p.HIncrBy(ctx, f.keys.Stats(), "dead_lettered", 1)
		return nil
	})
	if err != nil {
		log.Error("dead-lettering failed; the message is delivered again", slog.Any("dlq_error", err))
		_ = m.NakWithDelay(retryDelay(int(deliveries)))
		return
	}
	if err := m.Term(); err != nil {
		log.Warn("terminating a dead-lettered message failed; it may be dead-lettered again", slog.Any("error", err))
	}
	c.stats.deadLettered.Add(1)
	c.cfg.Metrics.deadLetter()
	log.Error("message moved to the dead-letter stream", slog.String("dlq", f.keys.DeadLetters()))
}
