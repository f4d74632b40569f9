package consumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer/source"
)

// Redis Streams as a Source: the consumer's own (New). A partition is a
// stream, read by the group through XREADGROUP under the consumer's name;
// what a read returns stays pending in the group until acknowledged (XACK).
//
// Its reader is where Redis Streams differ from a broker that delivers again
// by itself. A partition's new owner claims every entry still pending in the
// group, whoever it was delivered to, before anything new (the takeover);
// entries whose effect failed stay pending, and the reader reads them again,
// in stream order, after a backoff (a pass over its own pending entries),
// while the other keys go on; its gate holds each failed key's later
// entries back until then (order.go). Every ClaimInterval it claims entries
// idle for ClaimMinIdle (ones that keep failing, ones of a consumer that
// died). An owner that lost its lease and has not noticed yet can still read
// entries; the new owner adopts them before anything newer (adoptEarlier).

// streams is Redis Streams as a Source.
type streams struct {
	rdb redis.Cmdable
	cfg Config // the consumer's: its name, batch sizes and claim settings
	log *slog.Logger
}

var _ source.Source = (*streams)(nil)

func newStreams(rdb redis.Cmdable, cfg Config, log *slog.Logger) *streams {
	return &streams{rdb: rdb, cfg: cfg, log: log}
}

// System is "redis".
func (*streams) System() string { return "redis" }

// Ping checks that Redis answers.
func (s *streams) Ping(ctx context.Context) error { return s.rdb.Ping(ctx).Err() }

// CheckRetention has nothing to check: a group's place in a stream is kept
// with the stream, so a partition is not read again from its first entry
// (the relay trims the streams: docs/operations.md, "Redis memory").
func (*streams) CheckRetention(context.Context, string, time.Duration) (bool, error) {
	return true, nil
}

// CreateGroup creates the consumer group of subject (and the stream) if
// missing. It starts at "0", not "$": after a stream is lost and recreated,
// the relay may already have appended entries that must not be skipped.
func (s *streams) CreateGroup(ctx context.Context, group, subject string) error {
	err := s.rdb.XGroupCreateMkStream(ctx, subject, group, "0").Err()
	if err != nil && !redis.HasErrorPrefix(err, "BUSYGROUP") {
		return fmt.Errorf("create consumer group %s on %s: %w", group, subject, err)
	}
	return nil
}

// Backlog reads the group on the partition's stream (XINFO GROUPS); lag is
// negative when Redis cannot tell (entries deleted).
func (s *streams) Backlog(ctx context.Context, group, subject string, _ int) (pending, lag int64, found bool, err error) {
	groups, err := s.rdb.XInfoGroups(ctx, subject).Result()
	if err != nil && !redis.HasErrorPrefix(err, "no such key") {
		return 0, 0, false, err
	}
	for _, g := range groups {
		if g.Name == group {
			return g.Pending, g.Lag, true, nil
		}
	}
	return 0, 0, false, nil
}

// Open creates the group if missing (CreateGroup) and returns the
// partition's reader: its first reads take over what is pending in the
// group.
func (s *streams) Open(ctx context.Context, p source.Partition) (source.Reader, error) {
	if err := s.CreateGroup(ctx, p.Group, p.Subject); err != nil {
		return nil, err
	}
	return s.reader(p, newGate()), nil
}

func (s *streams) reader(p source.Partition, g *gate) *streamReader {
	return &streamReader{s: s, p: p, gate: g, mine: map[string]bool{}, count: s.cfg.BatchSize, takeover: "0-0", claimFrom: "0-0",
		lastClaim: time.Now()}
}

// streamReader reads one partition's stream for its owner (p.Owner, the
// lease value: empty for the single steps, which own nothing).
type streamReader struct {
	s    *streams
	p    source.Partition
	gate *gate
	acks []string // entries to acknowledge at the next Flush
	// mine are the entries this reader returned and that are not settled:
	// pending with it, as the gate's are (adoptEarlier leaves both).
	mine map[string]bool

	last readKind // what the last Read read

	created, takenOver bool
	takeover           string // where the takeover's XAUTOCLAIM goes on

	pass            *pendingPass // a pass over own pending entries under way
	needPending     bool         // own entries wait for a retry
	pendingFailures int          // passes in a row that failed
	retryPendingAt  time.Time

	claiming  bool   // a claim of idle entries is under way
	claimFrom string // where it goes on
	lastClaim time.Time

	count int        // new entries per read (nextCount)
	ahead *readAhead // the next read of new entries, sent under a backlog
	// queue are the batches the next Reads return first: the new entries
	// read after earlier ones adopted, each in a batch of its own.
	queue [][]source.Message
	// stepFailed: an effect failed on a page of the takeover or claim under
	// way, which goes on (the gate holds the failed keys) and backs off
	// once it has ended.
	stepFailed bool
}

type readKind int

const (
	readTakeover readKind = iota
	readPending
	readClaim
	readNew
)

// pendingPass is a pass over this consumer's own pending entries, from the
// oldest: seen are those it met, failed whether an effect failed in it.
type pendingPass struct {
	cursor string
	seen   map[entryID]bool
	failed bool
}

// String names the stream, for the consumer's log.
func (r *streamReader) String() string { return "stream " + r.p.Subject }

// Valid: a stream's reader stays in order whatever failed (what failed
// stays pending, and its gate holds the keys back).
func (r *streamReader) Valid() bool { return true }

// Failed: the consumer's backoff paces the next read (resume says when it
// need not).
func (r *streamReader) Failed(error) {}

// resume is told why a read or the effects of what it returned failed, and
// says whether the consumer waits out its backoff before reading on: not
// for a pass over the pending entries (the reader retries them after its
// own backoff, while new entries go on: one entry that keeps failing must
// not stop the rest), nor once a deleted group is created again.
func (r *streamReader) resume(ctx context.Context, log *slog.Logger, err error) (wait bool) {
	switch {
	case redis.HasErrorPrefix(err, "NOGROUP"):
		log.Warn("consumer group missing (stream deleted?); recreating it")
		r.created, r.needPending = false, true
		if err := r.s.CreateGroup(ctx, r.p.Group, r.p.Subject); err != nil {
			log.Warn("recreating group failed", slog.Any("error", err))
			return true
		}
		return false
	case r.last == readPending && r.pass != nil && effectFailedOnly(err):
		r.pass.failed = true // the rest of the pass goes on: the gate holds the failed keys
		return false
	case r.last == readPending:
		r.pass = &pendingPass{failed: true}
		r.endPass(log, err)
		return false
	case effectFailedOnly(err) && (r.last == readTakeover && !r.takenOver || r.last == readClaim && r.claiming):
		r.stepFailed = true
		return false
	}
	if !effectFailedOnly(err) {
		// New entries read after earlier ones whose batch failed stay
		// pending, for the next adoption or retry to apply in order.
		for _, batch := range r.queue {
			for _, m := range batch {
				delete(r.mine, m.ID())
			}
		}
		r.queue = nil
	}
	// Entries the read left pending, or whose effects failed: they are
	// applied by the retry of the pending entries, in order.
	r.needPending, r.stepFailed = true, false
	return true
}

// Read returns the entries to apply next: the ones a read sent ahead read;
// while the partition is being taken over, the group's pending entries;
// when due, a page of a pass over its own pending entries, or of a claim of
// idle ones; otherwise new entries, after any earlier ones adopted.
func (r *streamReader) Read(ctx context.Context, n int, block time.Duration) ([]source.Message, error) {
	if len(r.queue) > 0 {
		msgs := r.queue[0]
		r.queue = r.queue[1:]
		r.last = readNew
		return msgs, nil
	}
	if r.stepFailed && r.takenOver && !r.claiming {
		// The takeover or claim that failed on a page has ended: back off
		// once now (r.last is still its kind).
		r.stepFailed = false
		return nil, fmt.Errorf("%w: entries of the partition's takeover or claim of idle entries", errEffect)
	}
	if !r.gate.empty() {
		// Entries wait behind a failed one of their key: they are applied
		// by the retry of the pending entries, in order.
		r.needPending = true
	}
	pendingDue := r.pass != nil || (r.needPending && !time.Now().Before(r.retryPendingAt))
	claimDue := r.claiming || time.Since(r.lastClaim) >= r.s.cfg.ClaimInterval
	switch {
	case r.ahead != nil:
		// What it read follows what was just applied: before anything
		// else; and it reads on only when nothing else is due, so that a
		// backlog does not put off the retries.
		r.last = readNew
		return r.readNew(ctx, block, !pendingDue && !claimDue)
	case !r.takenOver:
		r.last = readTakeover
		return r.takeOverPage(ctx)
	case pendingDue:
		r.last = readPending
		if r.pass == nil {
			r.pass = &pendingPass{cursor: "0", seen: map[entryID]bool{}}
		}
		msgs, err := r.pendingPage(ctx)
		if err == nil && r.pass != nil && len(msgs) == 0 {
			r.endPass(r.s.log.With(slog.Int("partition", r.p.N)), nil)
		}
		return msgs, err
	case claimDue:
		r.last = readClaim
		return r.claimPage(ctx, r.s.cfg.ClaimMinIdle)
	default:
		r.last = readNew
		_ = n // the reader sizes its reads itself (nextCount), from Config.BatchSize
		if r.needPending {
			// The retry of the pending entries is due then: a read that
			// blocked past it would put the retry off by up to Block.
			block = min(block, max(time.Until(r.retryPendingAt), time.Millisecond))
		}
		return r.readNew(ctx, block, true)
	}
}

// takeOverPage reads a page of the takeover: every entry pending in the
// group, whoever it was delivered to, is older than every entry not yet
// delivered, and is applied first, in stream order. (The consumer is created
// first, so that XINFO CONSUMERS lists it before it has read anything.)
// Effects that fail do not keep the partition in its takeover: their
// entries stay pending, in the gate, and are retried with the pending ones
// while the other keys go on.
func (r *streamReader) takeOverPage(ctx context.Context) ([]source.Message, error) {
	if !r.created {
		if err := r.s.rdb.XGroupCreateConsumer(ctx, r.p.Subject, r.p.Group, r.s.cfg.Consumer).Err(); err != nil {
			return nil, err
		}
		r.created = true
	}
	msgs, next, err := r.autoClaim(ctx, 0, r.takeover)
	if err != nil {
		return nil, err
	}
	if next == "" {
		r.takenOver = true
	} else {
		r.takeover = next
	}
	return r.messages(ctx, msgs, true), nil
}

// claimPage reads a page of the claim of the entries idle for at least
// minIdle (their consumer died, or they keep failing), from the oldest.
func (r *streamReader) claimPage(ctx context.Context, minIdle time.Duration) ([]source.Message, error) {
	r.claiming = true
	msgs, next, err := r.autoClaim(ctx, minIdle, r.claimFrom)
	if err != nil || next == "" {
		r.claiming, r.claimFrom, r.lastClaim = false, "0-0", time.Now()
	} else {
		r.claimFrom = next
	}
	if err != nil {
		return nil, err
	}
	return r.messages(ctx, msgs, true), nil
}

// autoClaim claims a page of the entries idle for minIdle from start; next
// is where the next page starts ("": none is left).
func (r *streamReader) autoClaim(ctx context.Context, minIdle time.Duration, start string) (msgs []redis.XMessage, next string, err error) {
	msgs, next, err = r.s.rdb.XAutoClaim(ctx, &redis.XAutoClaimArgs{
		Stream: r.p.Subject, Group: r.p.Group, Consumer: r.s.cfg.Consumer,
		MinIdle: minIdle, Start: start, Count: int64(r.s.cfg.BatchSize),
	}).Result()
	if err != nil {
		return nil, "", fmt.Errorf("xautoclaim: %w", err)
	}
	if len(msgs) > 0 {
		r.s.log.Info("claimed pending entries", slog.Int("partition", r.p.N), slog.Int("entries", len(msgs)),
			slog.Duration("min_idle", minIdle))
	}
	if next == "0-0" {
		next = ""
	}
	return msgs, next, nil
}

// pendingPage re-reads a page of this consumer's own pending entries, from
// where its pass is; none left ends the pass (the caller's endPass).
func (r *streamReader) pendingPage(ctx context.Context) ([]source.Message, error) {
	res, err := r.s.rdb.XReadGroup(ctx, &redis.XReadGroupArgs{
		Group: r.p.Group, Consumer: r.s.cfg.Consumer, Streams: []string{r.p.Subject, r.pass.cursor},
		Count: int64(r.s.cfg.BatchSize),
		Block: -1, // an explicit id never blocks; -1 leaves BLOCK out
	}).Result()
	if errors.Is(err, redis.Nil) || (err == nil && (len(res) == 0 || len(res[0].Messages) == 0)) {
		// A whole pass: what the gate holds and this pass did not meet is
		// pending with this consumer no more.
		r.gate.keep(r.pass.seen)
		for id := range r.mine {
			if !r.pass.seen[parseEntryID(id)] {
				delete(r.mine, id)
			}
		}
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read pending: %w", err)
	}
	msgs := res[0].Messages
	for _, m := range msgs {
		r.pass.seen[parseEntryID(m.ID)] = true
	}
	// The pass goes on after the last entry, so that an entry that failed
	// again is not re-read in a tight loop.
	r.pass.cursor = msgs[len(msgs)-1].ID
	return r.messages(ctx, msgs, true), nil
}

// endPass ends the pass over the pending entries and schedules the next:
// after the retry backoff when it failed (err, or an effect in it), soon
// otherwise if the gate still holds entries back (none should be left, but
// if one is, not in a tight loop).
func (r *streamReader) endPass(log *slog.Logger, err error) {
	failed := r.pass.failed
	r.pass = nil
	if !failed {
		r.needPending, r.pendingFailures = !r.gate.empty(), 0
		r.retryPendingAt = time.Now().Add(retryDelay(1))
		return
	}
	r.needPending = true
	r.pendingFailures++
	d := retryDelay(r.pendingFailures)
	r.retryPendingAt = time.Now().Add(d)
	log.Warn("pending entries failed again; retrying", slog.Any("error", cmp.Or[error](err, errEffect)), slog.Duration("retry_in", d))
}

// readNew reads up to r.count new entries, blocking up to block, or takes
// what the read sent ahead read. Under a backlog (the read came back full),
// and when readOn, it sends the next read before the entries are applied:
// Redis answers it while their effects run, instead of after them. The
// entries come after any earlier ones adopted (adoptEarlier); a read that
// comes back empty adopts what another reader left pending, up to the
// stream's end: a read of new entries adopts only what is older than them,
// and when nothing comes after what a fenced reader took, nothing else
// would before ClaimMinIdle.
func (r *streamReader) readNew(ctx context.Context, block time.Duration, readOn bool) ([]source.Message, error) {
	var res []redis.XStream
	var err error
	count := r.count
	if a := r.ahead; a != nil {
		r.ahead = nil
		<-a.done
		res, err, count = a.res, a.err, a.count
	} else {
		res, err = r.xreadgroup(ctx, count, block)
	}
	var fresh []redis.XMessage
	if err == nil && len(res) == 1 {
		fresh = res[0].Messages
	}
	r.count = r.s.nextCount(count, len(fresh))
	if readOn && err == nil && len(fresh) >= count && ctx.Err() == nil {
		r.ahead = r.sendReadAhead(ctx, r.count)
	}
	if err != nil {
		return nil, err
	}
	before := ""
	if len(fresh) > 0 {
		before = fresh[0].ID
	}
	earlier, err := r.adoptEarlier(ctx, before)
	adopted := r.messages(ctx, earlier, true)
	if err != nil {
		// The new entries stay pending with this consumer: the retry of the
		// pending entries, or the next adoption, applies them.
		return adopted, err
	}
	msgs := r.messages(ctx, fresh, false)
	if len(adopted) == 0 {
		return msgs, nil
	}
	// The earlier entries first, in batches of their own (at most
	// MaxBatchSize each), then the new ones.
	var batches [][]source.Message
	for len(adopted) > 0 {
		k := min(len(adopted), r.s.cfg.MaxBatchSize)
		batches = append(batches, adopted[:k])
		adopted = adopted[k:]
	}
	if len(msgs) > 0 {
		batches = append(batches, msgs)
	}
	r.queue = append(r.queue, batches[1:]...)
	return batches[0], nil
}

// readAhead is a read of new entries sent before the entries read before
// them are applied: done is closed once its reply is in.
type readAhead struct {
	count int // entries asked for
	done  chan struct{}
	res   []redis.XStream
	err   error
}

// sendReadAhead reads up to count new entries, without blocking, on a
// goroutine of its own. The entries it reads are pending under this
// consumer's name until applied: if the worker stops first, whoever takes
// the partition over applies them, as after a crash.
func (r *streamReader) sendReadAhead(ctx context.Context, count int) *readAhead {
	a := &readAhead{count: count, done: make(chan struct{})}
	go func() {
		defer close(a.done)
		a.res, a.err = r.xreadgroup(ctx, count, -1) // -1 leaves BLOCK out
	}()
	return a
}

// close waits for a read sent ahead, so that nothing reads after the
// partition's worker stopped.
func (r *streamReader) close() {
	if r.ahead != nil {
		<-r.ahead.done
		r.ahead = nil
	}
}

// nextCount is how many new entries the read after one that asked for
// count and got n asks for: twice as many after a full read (a backlog), up
// to MaxBatchSize; BatchSize otherwise.
func (s *streams) nextCount(count, n int) int {
	if n >= count {
		return min(2*count, s.cfg.MaxBatchSize)
	}
	return s.cfg.BatchSize
}

// xreadgroup reads up to count new entries, blocking up to block; a read
// that timed out is no error.
func (r *streamReader) xreadgroup(ctx context.Context, count int, block time.Duration) ([]redis.XStream, error) {
	return r.s.xreadgroup(ctx, r.p.Group, []string{r.p.Subject, ">"}, count, block)
}

// A blocking read waits in slices of at most readSlice, and none begins
// once ctx is done: Redis does not see a cancelled context, and a worker told
// to stop (its partition handed over to another member, or the consumer
// shutting down) would otherwise hold its partition, lease and all, until
// the whole block ran out. (The cost: an idle partition's reader asks again
// every readSlice; docs/design.md.)
func (s *streams) xreadgroup(ctx context.Context, group string, streams []string, count int, block time.Duration) ([]redis.XStream, error) {
	if block > 0 {
		// Redis takes whole milliseconds, and BLOCK 0 is forever: a
		// slice under one would wait until the client gave up (10 s on).
		block = max(block.Round(time.Millisecond), time.Millisecond)
	}
	for {
		wait := block
		if block > 0 {
			wait = min(block, readSlice)
			block -= wait
		}
		res, err := s.rdb.XReadGroup(ctx, &redis.XReadGroupArgs{
			Group: group, Consumer: s.cfg.Consumer, Streams: streams, Count: int64(count), Block: wait,
		}).Result()
		if isTimeout(err) {
			return nil, nil // the client gave up on the reply: no slice more on it
		}
		if !errors.Is(err, redis.Nil) {
			return res, err
		}
		if block <= 0 {
			return nil, nil
		}
		if err := ctx.Err(); err != nil {
			return nil, err
		}
	}
}

// readSlice is the longest a blocking read waits before its reader looks
// whether it was told to stop.
const readSlice = 250 * time.Millisecond

// adoptEarlier claims the entries of the partition still pending with
// other consumers that are older than before (empty: up to the stream's
// end). The new owner of a partition applies every pending entry when it
// takes the partition over, but the previous owner, not knowing yet that it
// lost the lease, may read more entries after that (its XREADGROUP was
// blocked waiting for them): its effects are fenced, and the entries would
// stay in its pending list while the new owner applies the later ones.
// (Found by the chaos suite on a cluster: a sender's TED judged after the
// next one.) The same goes for entries pending under this consumer's own
// name that this reader did not read: a twin process under the name (one
// that stalled past its name's lease and came back) read them. Only with
// partition ownership (an owner); the entries this reader left pending
// itself (failed, held, invalid: its gate knows them) are retried as before.
func (r *streamReader) adoptEarlier(ctx context.Context, before string) ([]redis.XMessage, error) {
	if r.p.Owner == "" {
		return nil, nil
	}
	start, end := "-", "+"
	if before != "" {
		end = "(" + before
	}
	var adopted []redis.XMessage
	for ctx.Err() == nil {
		pending, err := r.s.rdb.XPendingExt(ctx, &redis.XPendingExtArgs{
			Stream: r.p.Subject, Group: r.p.Group, Start: start, End: end, Count: int64(r.s.cfg.BatchSize),
		}).Result()
		if err != nil {
			return adopted, fmt.Errorf("pending entries before %s: %w", cmp.Or(before, "the end"), err)
		}
		var ids []string
		for _, p := range pending {
			if p.Consumer != r.s.cfg.Consumer || !(r.mine[p.ID] || r.gate.knows(p.ID)) {
				ids = append(ids, p.ID)
			}
		}
		if len(ids) > 0 {
			msgs, err := r.s.rdb.XClaim(ctx, &redis.XClaimArgs{
				Stream: r.p.Subject, Group: r.p.Group, Consumer: r.s.cfg.Consumer, Messages: ids,
			}).Result()
			if err != nil {
				return adopted, fmt.Errorf("xclaim earlier entries: %w", err)
			}
			r.s.log.Info("claimed earlier entries pending with another consumer (or a twin under this name)",
				slog.Int("partition", r.p.N), slog.Int("entries", len(msgs)), slog.String("before", cmp.Or(before, "the end")))
			adopted = append(adopted, msgs...)
		}
		if len(pending) < r.s.cfg.BatchSize {
			return adopted, nil
		}
		start = "(" + pending[len(pending)-1].ID
	}
	return adopted, ctx.Err()
}

// messages wraps entries read; redelivered ones (own pending, claimed) have
// their delivery counts looked up with one XPENDING call, new ones are on
// their first.
func (r *streamReader) messages(ctx context.Context, xs []redis.XMessage, redelivered bool) []source.Message {
	if len(xs) == 0 {
		return nil
	}
	counts := map[string]int64{}
	if redelivered {
		// Other entries pending with this consumer may lie between them:
		// page on until the last one.
		start := xs[0].ID
		for ctx.Err() == nil {
			pend, err := r.s.rdb.XPendingExt(ctx, &redis.XPendingExtArgs{
				Stream: r.p.Subject, Group: r.p.Group, Consumer: r.s.cfg.Consumer,
				Start: start, End: xs[len(xs)-1].ID, Count: int64(len(xs)),
			}).Result()
			if err != nil { // counted 0: an invalid entry waits for a later delivery to be dead-lettered
				break
			}
			for _, p := range pend {
				counts[p.ID] = p.RetryCount
			}
			if len(pend) < len(xs) || pend[len(pend)-1].ID == xs[len(xs)-1].ID {
				break
			}
			start = "(" + pend[len(pend)-1].ID
		}
	}
	msgs := make([]source.Message, len(xs))
	for i, x := range xs {
		d := int64(1)
		if redelivered {
			d = counts[x.ID]
		}
		msgs[i] = &streamMessage{r: r, x: x, deliveries: d}
		r.mine[x.ID] = true
	}
	return msgs
}

// Flush acknowledges the entries done since the last Flush, in one XACK.
func (r *streamReader) Flush(timeout time.Duration) error {
	if len(r.acks) == 0 {
		return nil
	}
	ids := r.acks
	r.acks = nil
	// Not less than ackTimeout: an acknowledgement that fails leaves its
	// entries to be applied again (as duplicates).
	ctx, cancel := context.WithTimeout(context.Background(), max(timeout, ackTimeout))
	defer cancel()
	if err := r.s.rdb.XAck(ctx, r.p.Subject, r.p.Group, ids...).Err(); err != nil {
		return fmt.Errorf("xack %d entries: %w", len(ids), err)
	}
	return nil
}

// ackTimeout bounds an XACK at the least (the read's Block may be 1 ms).
const ackTimeout = 5 * time.Second

// streamMessage is one entry as a stream's reader read it.
type streamMessage struct {
	r          *streamReader
	x          redis.XMessage
	deliveries int64
}

func (m *streamMessage) Values() map[string]any { return m.x.Values }
func (m *streamMessage) ID() string             { return m.x.ID }
func (m *streamMessage) Subject() string        { return m.r.p.Subject }
func (m *streamMessage) Deliveries() int64      { return m.deliveries }

// Ack acknowledges the entry at the reader's next Flush.
func (m *streamMessage) Ack() error {
	m.r.acks = append(m.r.acks, m.x.ID)
	delete(m.r.mine, m.x.ID)
	return nil
}

// Nak leaves the entry pending: the reader's retry of its pending entries
// reads it again, or a claim of idle entries (delay is the reader's own
// backoff's business).
func (m *streamMessage) Nak(time.Duration) error { return nil }

// Term acknowledges the entry at the reader's next Flush.
func (m *streamMessage) Term() error { return m.Ack() }

// deadLetter moves the entry to the dead-letter stream atomically with its
// XACK (deadletter.lua); moved is false when it was no longer pending
// (someone acknowledged it).
func (m *streamMessage) deadLetter(ctx context.Context, c *Consumer, f feed, reason string, deliveries int64) (moved bool, err error) {
	n, err := deadLetterScript.Run(ctx, c.rdb, []string{f.stream, f.keys.DeadLetters(), f.keys.Stats()},
		c.cfg.Group, m.x.ID, reason, deliveries, c.cfg.Consumer).Int()
	if err == nil {
		delete(m.r.mine, m.x.ID)
	}
	return n == 1, err
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
