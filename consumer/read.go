package consumer

import (
	"cmp"
	"context"
	_ "embed"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/retry"
)

// stepReadNew blocks up to Config.Block for new entries of every partition
// and processes them. Run is how to consume: stepReadNew,
// stepProcessPending and stepClaimIdle are its single steps, without
// partition ownership, for the tests that drive a consumer by hand
// (internal/consumertest); with several partitions stepReadNew reads them in
// one command, which a Redis Cluster refuses.
func (c *Consumer) stepReadNew(ctx context.Context) (int, error) {
	if c.src != nil {
		return 0, errSingleStepsRedisOnly
	}
	streams := make([]string, 0, 2*len(c.parts))
	for _, pt := range c.parts {
		streams = append(streams, pt.stream)
	}
	for range c.parts {
		streams = append(streams, ">")
	}
	return c.read(ctx, streams, c.cfg.BatchSize, func(stream string) feed {
		for _, pt := range c.parts {
			if pt.stream == stream {
				return feed{part: pt, gate: c.gates[pt.n]}
			}
		}
		panic("consumer: XREADGROUP replied with a stream it was not asked for: " + stream)
	})
}

// readNew blocks up to Config.Block for up to count new entries of f and
// processes them; ahead, when not nil, is that read, sent while the batch
// before was applied. Under a backlog (the read came back full), and when
// readOn, it sends the next read before it processes the entries (next):
// Redis answers it while the effects of these run, instead of after them.
// A read that comes back empty adopts what another reader left pending in
// f's partition (adoptEarlier, up to the stream's end): a read of new
// entries adopts only what is older than them, and when nothing comes after
// what a fenced reader took, nothing else would before ClaimMinIdle.
func (c *Consumer) readNew(ctx context.Context, f feed, count int, ahead *readAhead, readOn bool) (n int, next *readAhead, err error) {
	var res []redis.XStream
	if ahead != nil {
		<-ahead.done
		res, err, count = ahead.res, ahead.err, ahead.count
	} else {
		res, err = c.xreadgroup(ctx, []string{f.stream, ">"}, count, c.cfg.Block)
	}
	if readOn && err == nil && len(res) == 1 && len(res[0].Messages) >= count && ctx.Err() == nil {
		next = c.sendReadAhead(ctx, f, c.nextCount(count, len(res[0].Messages)))
	}
	n, err = c.process(ctx, res, err, func(string) feed { return f })
	if n == 0 && err == nil {
		err = c.adoptEarlier(ctx, f, "")
	}
	return n, next, err
}

// readAhead is a read of new entries sent before the entries read before
// them are processed: done is closed once its reply is in.
type readAhead struct {
	count int // entries asked for
	done  chan struct{}
	res   []redis.XStream
	err   error
}

// sendReadAhead reads up to count new entries of f, without blocking, on a
// goroutine of its own. The entries it reads are pending under this
// consumer's name until processed: if the worker stops first, whoever
// takes the partition over applies them (Run), as after a crash.
func (c *Consumer) sendReadAhead(ctx context.Context, f feed, count int) *readAhead {
	a := &readAhead{count: count, done: make(chan struct{})}
	go func() {
		defer close(a.done)
		a.res, a.err = c.xreadgroup(ctx, []string{f.stream, ">"}, count, -1) // -1 leaves BLOCK out
	}()
	return a
}

// nextCount is how many new entries the read after one that asked for
// count and got n asks for: twice as many after a full read (a backlog), up
// to MaxBatchSize; BatchSize otherwise.
func (c *Consumer) nextCount(count, n int) int {
	if n >= count {
		return min(2*count, c.cfg.MaxBatchSize)
	}
	return c.cfg.BatchSize
}

// read blocks up to Config.Block for up to count new entries of streams
// and processes them.
func (c *Consumer) read(ctx context.Context, streams []string, count int, feedOf func(stream string) feed) (int, error) {
	res, err := c.xreadgroup(ctx, streams, count, c.cfg.Block)
	return c.process(ctx, res, err, feedOf)
}

// xreadgroup reads up to count new entries of streams, blocking up to
// block; a read that timed out is no error.
func (c *Consumer) xreadgroup(ctx context.Context, streams []string, count int, block time.Duration) ([]redis.XStream, error) {
	res, err := c.rdb.XReadGroup(ctx, &redis.XReadGroupArgs{
		Group:    c.cfg.Group,
		Consumer: c.cfg.Consumer,
		Streams:  streams,
		Count:    int64(count),
		Block:    block,
	}).Result()
	if errors.Is(err, redis.Nil) || isTimeout(err) {
		return nil, nil
	}
	return res, err
}

// process applies the entries a read returned (res, or its error err), each
// stream's after what is pending from before them (adoptEarlier).
func (c *Consumer) process(ctx context.Context, res []redis.XStream, err error, feedOf func(stream string) feed) (int, error) {
	if err != nil {
		return 0, err
	}
	n := 0
	for _, s := range res {
		n += len(s.Messages)
		f := feedOf(s.Stream)
		if err := c.adoptEarlier(ctx, f, s.Messages[0].ID); err != nil {
			return n, err
		}
		if err := c.handle(ctx, f, s.Messages, false); err != nil {
			return n, err
		}
	}
	return n, nil
}

// adoptEarlier claims and applies, before the entries from before on, the
// entries of f's partition still pending with other consumers that are older
// than before. The new owner of a partition applies every pending entry when
// it takes the partition over, but the previous owner, not knowing yet that
// it lost the lease, may read more entries after that (its XREADGROUP was
// blocked waiting for them): its effects are fenced, and the entries would
// stay in its pending list while the new owner applies the later ones.
// (Found by the chaos suite on a cluster: a sender's TED judged after the
// next one.) The same goes for entries pending under this consumer's own
// name that this worker did not read: a twin process under the name (one
// that stalled past its name's lease and came back) read them. Only with
// partition ownership (f.fence set); the entries this worker left pending
// itself (failed, held, invalid: its gate knows them) are retried as before.
// An empty before adopts up to the stream's end (readNew, after an empty
// read).
func (c *Consumer) adoptEarlier(ctx context.Context, f feed, before string) error {
	if f.fence == "" {
		return nil
	}
	start, end := "-", "+"
	if before != "" {
		end = "(" + before
	}
	for ctx.Err() == nil {
		pending, err := c.rdb.XPendingExt(ctx, &redis.XPendingExtArgs{
			Stream: f.stream, Group: c.cfg.Group, Start: start, End: end, Count: int64(c.cfg.BatchSize),
		}).Result()
		if err != nil {
			return fmt.Errorf("pending entries before %s: %w", cmp.Or(before, "the end"), err)
		}
		var ids []string
		for _, p := range pending {
			if p.Consumer != c.cfg.Consumer || !f.gate.knows(p.ID) {
				ids = append(ids, p.ID)
			}
		}
		if len(ids) > 0 {
			msgs, err := c.rdb.XClaim(ctx, &redis.XClaimArgs{
				Stream: f.stream, Group: c.cfg.Group, Consumer: c.cfg.Consumer, Messages: ids,
			}).Result()
			if err != nil {
				return fmt.Errorf("xclaim earlier entries: %w", err)
			}
			c.log.Info("claimed earlier entries pending with another consumer (or a twin under this name)",
				slog.Int("partition", f.n), slog.Int("entries", len(msgs)), slog.String("before", cmp.Or(before, "the end")))
			if err := c.handle(ctx, f, msgs, true); err != nil {
				return err
			}
		}
		if len(pending) < c.cfg.BatchSize {
			return nil
		}
		start = "(" + pending[len(pending)-1].ID
	}
	return ctx.Err()
}

// stepProcessPending re-reads and processes this consumer's own pending
// entries of every partition, from the oldest, until none is left that it
// has not tried in this pass (a single step of Run: see stepReadNew).
func (c *Consumer) stepProcessPending(ctx context.Context) error {
	if c.src != nil {
		return errSingleStepsRedisOnly
	}
	for _, pt := range c.parts {
		if err := c.processPending(ctx, feed{part: pt, gate: c.gates[pt.n]}); err != nil {
			return err
		}
	}
	return nil
}

func (c *Consumer) processPending(ctx context.Context, f feed) error {
	cursor := "0"
	seen := map[entryID]bool{}
	var failed error // the last effect failure of the pass
	for ctx.Err() == nil {
		res, err := c.rdb.XReadGroup(ctx, &redis.XReadGroupArgs{
			Group:    c.cfg.Group,
			Consumer: c.cfg.Consumer,
			Streams:  []string{f.stream, cursor},
			Count:    int64(c.cfg.BatchSize),
			Block:    -1, // an explicit id never blocks; -1 leaves BLOCK out
		}).Result()
		if errors.Is(err, redis.Nil) || (err == nil && (len(res) == 0 || len(res[0].Messages) == 0)) {
			// A whole pass: what the gate holds and this pass did not
			// meet is pending with this consumer no more.
			f.gate.keep(seen)
			return failed
		}
		if err != nil {
			return fmt.Errorf("read pending: %w", err)
		}
		msgs := res[0].Messages
		for _, m := range msgs {
			seen[parseEntryID(m.ID)] = true
		}
		if err := c.handle(ctx, f, msgs, true); effectFailedOnly(err) {
			failed = err // the rest of the pass goes on: the gate holds the failed keys
		} else if err != nil {
			return err
		}
		// Continue after the last entry, so an entry that failed again is
		// not re-read in a tight loop.
		cursor = msgs[len(msgs)-1].ID
	}
	return failed
}

// stepClaimIdle claims the entries of every partition idle for at least
// ClaimMinIdle (their consumer died, or they keep failing) and processes
// them (a single step of Run: see stepReadNew). It returns how many it claimed.
func (c *Consumer) stepClaimIdle(ctx context.Context) (int, error) {
	if c.src != nil {
		return 0, errSingleStepsRedisOnly
	}
	total := 0
	for _, pt := range c.parts {
		n, err := c.claim(ctx, feed{part: pt, gate: c.gates[pt.n]}, c.cfg.ClaimMinIdle)
		total += n
		if err != nil {
			return total, err
		}
	}
	return total, nil
}

// claim claims f's entries idle for at least minIdle, from the oldest, and
// processes them. It returns how many it claimed. Effects that fail do not
// stop it (the gate holds back their keys' later entries); it returns the
// last such failure at the end.
func (c *Consumer) claim(ctx context.Context, f feed, minIdle time.Duration) (int, error) {
	start, total := "0-0", 0
	var failed error
	for ctx.Err() == nil {
		msgs, next, err := c.rdb.XAutoClaim(ctx, &redis.XAutoClaimArgs{
			Stream:   f.stream,
			Group:    c.cfg.Group,
			Consumer: c.cfg.Consumer,
			MinIdle:  minIdle,
			Start:    start,
			Count:    int64(c.cfg.BatchSize),
		}).Result()
		if err != nil {
			return total, fmt.Errorf("xautoclaim: %w", err)
		}
		total += len(msgs)
		if len(msgs) > 0 {
			c.log.Info("claimed pending entries", slog.Int("partition", f.n), slog.Int("entries", len(msgs)),
				slog.Duration("min_idle", minIdle))
			if err := c.handle(ctx, f, msgs, true); effectFailedOnly(err) {
				failed = err
			} else if err != nil {
				return total, err
			}
		}
		if next == "0-0" || next == "" {
			break
		}
		start = next
	}
	return total, failed
}

// deliveries returns each entry's delivery count, for logs. New entries are
// on their first delivery; redelivered ones (own pending, claimed) are looked
// up with one XPENDING call.
func (c *Consumer) deliveries(ctx context.Context, f feed, msgs []redis.XMessage, redelivered bool) func(id string) int64 {
	if !redelivered || len(msgs) == 0 {
		return func(string) int64 { return 1 }
	}
	counts := map[string]int64{}
	pend, err := c.rdb.XPendingExt(ctx, &redis.XPendingExtArgs{
		Stream: f.stream, Group: c.cfg.Group, Consumer: c.cfg.Consumer,
		Start: msgs[0].ID, End: msgs[len(msgs)-1].ID, Count: int64(len(msgs)),
	}).Result()
	if err == nil {
		for _, p := range pend {
			counts[p.ID] = p.RetryCount
		}
	}
	return func(id string) int64 { return counts[id] }
}

// retryDelay backs off to MaxRetryDelay: a consumer failing on every entry
// must not spin.
func retryDelay(failures int) time.Duration {
	return retry.Backoff(failures, 100*time.Millisecond, MaxRetryDelay)
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
