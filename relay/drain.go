package relay

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"time"

	"github.com/tedbank/outbox/internal/retry"
)

// drain publishes batches until a claim finds nothing, backing off while the
// broker is unavailable, and returns the rows published.
//
// It does not stop at a short batch: publishing an event can make the next
// event of the same aggregate claimable, and no notification announces that.
//
// While it drains, writers are told not to notify (their NOTIFY would
// serialize their commits for nothing); before it returns, it tells them to
// notify again and claims once more, so a row committed in between is never
// left for the fallback poll: the wake-up protocol (wakeup.go, type wakeup)
// says what each claim tells writers and what to do after it. A poll
// re-asserts "sleep" first, in case a relay that crashed while draining left
// writers silent.
func (r *Relay) drain(ctx context.Context, polled bool) (published int, err error) {
	if r.listener.resync.Swap(false) {
		r.setState(unsure)
		r.loop.resynced = r.listener.established.Load()
	}
	w := r.newWakeup(polled)
	// Redis refused the last batch as a whole: wait out the backoff before
	// the first claim, even if a notification woke this drain early, so that
	// an outage costs one probe per backoff step, not one per commit.
	if wait := time.Until(r.loop.broker.downUntil); wait > 0 {
		retry.Sleep(ctx, wait)
	}
	var pending *pendingMark // the last batch's mark, sent with the next claim
	flush := func() error {  // sends it on its own
		if pending == nil {
			return nil
		}
		var res BatchResult
		mctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), markTimeout)
		defer cancel()
		err := r.markPublished(mctx, &res, pending)
		pending = nil
		published += res.Published
		return err
	}
	defer func() {
		if ferr := flush(); ferr != nil {
			err = errors.Join(err, ferr)
		}
	}()
	for ctx.Err() == nil {
		if l := r.own.leases; l != nil {
			if err := l.beforeBatch(ctx, flush); err != nil {
				return published, err
			}
		}
		var res BatchResult
		res, pending, err = r.drainBatch(ctx, w.op, pending, true)
		w.sent(res, err)
		now := time.Now()
		for _, d := range res.retries {
			r.loop.retries.add(now.Add(d))
		}
		published += res.Published
		switch {
		case err != nil:
			return published, err
		case res.BrokerDown:
			if err := flush(); err != nil {
				return published, err
			}
			if r.retrySmaller(ctx, res) {
				continue
			}
			r.brokerRefused(ctx, res)
		case res.Claimed == 0:
			if w.empty(ctx) {
				return published, nil
			}
		default:
			r.brokerTook()
			w.published(ctx, res)
		}
	}
	return published, nil
}

// The broker refused batches as a whole: the next claim comes after
// brokerRetryMin, doubling up to brokerRetryMax.
const (
	brokerRetryMin = 100 * time.Millisecond
	brokerRetryMax = time.Second
)

// brokerRefused backs off after the broker refused a batch as a whole (no
// attempt counted), longer each time in a row, logging at the first and
// every 20th. Until the broker takes a batch again, claims take one row: a
// probe, so that an outage costs a round trip of one row per step, and the
// steps can stay short (brokerTook doubles the rows back).
func (r *Relay) brokerRefused(ctx context.Context, res BatchResult) {
	r.loop.broker.failures++
	r.loop.batchCap = 1
	d := retry.Backoff(r.loop.broker.failures, brokerRetryMin, brokerRetryMax)
	r.loop.broker.downUntil = time.Now().Add(d)
	level := slog.LevelDebug
	if r.loop.broker.failures == 1 || r.loop.broker.failures%20 == 0 {
		level = slog.LevelWarn
	}
	r.log.Log(ctx, level, "redis unavailable; backing off", slog.Int("released", res.Released),
		slog.Int("attempt", r.loop.broker.failures), slog.Duration("retry_in", d), slog.Any("error", res.Err))
	retry.Sleep(ctx, d)
}

// retrySmaller halves the rows of the next claims after a publish of
// several rows timed out (a pipeline too big for the broker to take within
// PublishTimeout, big payloads or a slow link), and reports whether it did:
// the batch is then tried again, smaller, once its rows are claimable again
// (releaseDelay), not after a backoff. A single row that times out backs
// off as a refused batch does. Successful batches double the cap back.
func (r *Relay) retrySmaller(ctx context.Context, res BatchResult) bool {
	if res.Released < 2 || !timedOut(res.Err) {
		return false
	}
	r.loop.batchCap = max(1, res.Released/2)
	r.log.Warn("publish timed out; trying again with smaller batches", slog.Int("rows", res.Released),
		slog.Int("next_batch", r.loop.batchCap), slog.Duration("publish_timeout", r.cfg.PublishTimeout), slog.Any("error", res.Err))
	retry.Sleep(ctx, releaseDelay)
	return true
}

// timedOut: err says the publish ran out of time.
func timedOut(err error) bool {
	var ne net.Error
	return errors.Is(err, context.DeadlineExceeded) || errors.As(err, &ne) && ne.Timeout()
}

// batchLimit is how many rows the next claim may take.
func (r *Relay) batchLimit() int {
	if r.loop.batchCap > 0 {
		return min(r.cfg.BatchSize, r.loop.batchCap)
	}
	return r.cfg.BatchSize
}

// brokerTook ends a run of refused batches.
func (r *Relay) brokerTook() {
	if r.loop.batchCap > 0 {
		if r.loop.batchCap *= 2; r.loop.batchCap >= r.cfg.BatchSize {
			r.loop.batchCap = 0
		}
	}
	if r.loop.broker.failures > 0 {
		r.log.Info("redis available again; publishing", slog.Int("refused_rounds", r.loop.broker.failures))
	}
	r.loop.broker.failures, r.loop.broker.downUntil = 0, time.Time{}
}
