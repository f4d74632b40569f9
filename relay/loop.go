package relay

import (
	"context"
	"log/slog"
	"time"

	"github.com/tedbank/outbox/internal/pgerr"
	"github.com/tedbank/outbox/internal/retry"
	"github.com/tedbank/outbox/internal/testsignal"
)

// drainState is what the drainer (drainLoop) owns between drains, on its
// goroutine only.
type drainState struct {
	// state is what this relay may assume about the writers (wakeup.go);
	// retries when rows it failed become claimable again; recent the
	// claims that found rows in the last busyWindow, across drains: the
	// commit rate the busy rule reads.
	state   wakeState
	retries retrySchedule
	recent  claimWindow
	// db paces drains while the database fails, broker batches while the
	// broker refuses them as a whole.
	db     dbBackoff
	broker brokerBackoff
	// batchCap, when not 0, caps the rows of a claim below BatchSize: a
	// publish timed out, and was retried smaller, or the broker refused a
	// batch, and claims probe it with one row (drain.go).
	batchCap int
	// floor is where the claims' reads start (floor.go); lastRead the rows
	// the last claim returned.
	floor    readFloor
	lastRead int
	// held: the tokens of the latest claims (claim.go), for a restamp after
	// the LISTEN connection came back (the listener reads them).
	held heldClaims
	// idle: a drain ended and the drainer waits, caught up, no wake-up
	// queued (tests only: testsignal.Relay); resynced is the LISTEN
	// connection (listener.established) whose catch-up drain started
	// last (the signal waits for a drain that succeeded after it).
	idle     testsignal.Signal[uint64]
	resynced uint64
}

// dbBackoff: failures counts drains in a row that failed (the database
// unreachable, a statement timed out); downSince is when the first failed,
// warned when the last warning was logged and retryAt when the backoff ends
// (polls wait for it; a notification does not). lost counts drains in a row
// tried again at once because the server closed their pooled connection
// (drainFailed).
type dbBackoff struct {
	failures                   int
	downSince, warned, retryAt time.Time
	lost                       int
}

// brokerBackoff: failures counts batches the broker refused as a whole in a
// row, across drains; downUntil is when the current backoff ends.
type brokerBackoff struct {
	failures  int
	downUntil time.Time
}

// drainLoop is the relay's one drainer: it drains at start, then whenever a
// notification, the fallback poll, a failed row's retry time or the end of a
// database backoff says so, until ctx is cancelled. With partition leases it
// also renews them while idle. It owns the wake-up state (wakeup.go), the
// retry schedule and the leases.
func (r *Relay) drainLoop(ctx context.Context) {
	wait := time.NewTimer(firstListenWait)
	select {
	case <-ctx.Done():
		wait.Stop()
		return
	case <-r.listener.tried:
	case <-wait.C:
	}
	wait.Stop()
	poll := time.NewTicker(r.cfg.PollInterval)
	defer poll.Stop()
	retryTimer := time.NewTimer(0)
	defer retryTimer.Stop()
	// On the way out, tell writers to notify again and wake the other
	// relays: they may be asleep, waiting for writers this relay silenced.
	defer r.sleepOnExit()
	// Before that, give back the partition leases (if any) so that the
	// relays it wakes can take them.
	defer r.own.leave()
	var renew <-chan time.Time // partition leases: renewals while idle
	if l := r.own.leases; l != nil {
		t := time.NewTicker(l.renewEvery())
		defer t.Stop()
		renew = t.C
	}
	polled := false
	for {
		started := time.Now()
		n, err := r.drain(ctx, polled)
		if polled && n > 0 {
			r.stats.pollsWithWork.Add(1)
			r.cfg.Metrics.polled(true)
		}
		polled = false
		var wait time.Duration // until the next drain at the latest (0: poll)
		switch {
		case ctx.Err() != nil:
		case err != nil:
			wait = r.drainFailed(n, err)
		default:
			r.drainSucceeded()
			// Rows that were claimable when this drain started were claimed.
			r.loop.retries.covered(started)
		}
		// Rows that failed become claimable again after their backoff; wake
		// up for them then rather than at the next poll.
		if at, ok := r.loop.retries.next(); ok {
			if d := time.Until(at); wait == 0 || d < wait {
				wait = max(d, time.Millisecond)
			}
		}
		retryTimer.Stop()
		if wait > 0 && wait < r.cfg.PollInterval {
			retryTimer.Reset(wait)
		}
		if err == nil && len(r.wake) == 0 && r.stats.listenUp.Load() && !r.listener.resync.Load() {
			// Caught up: listening, and the drain the LISTEN connection
			// asked for when it came up has run. (Between listenUp and
			// resync, resynced still names the connection before: a test
			// waits for a number past it.)
			r.loop.idle.Send(r.loop.resynced)
		}
	wait:
		select {
		case <-ctx.Done():
			return
		case <-r.wake:
		case <-retryTimer.C:
		case <-renew:
			r.own.leases.renew(ctx)
			goto wait // it kicks the drainer if it took slots
		case <-poll.C:
			if time.Now().Before(r.loop.db.retryAt) {
				goto wait // the database is failing: the backoff paces retries
			}
			r.stats.polls.Add(1)
			r.cfg.Metrics.polled(false)
			polled = true
		}
	}
}

// A drain that failed (the database unreachable, a statement timed out) is
// tried again after a backoff from drainRetryMin to drainRetryMax; while it
// keeps failing, a warning is logged at most every drainWarnEvery.
const (
	drainRetryMin  = 100 * time.Millisecond
	drainRetryMax  = time.Second
	drainWarnEvery = 30 * time.Second
)

// drainFailed records a drain that failed after publishing published rows
// and returns how soon to try again: at once when the server closed the
// pooled connection the drain ran on (the next one runs on a fresh
// connection: a flapping link or a restarted pooler costs no backoff), else
// after a backoff that grows while drains fail. A drain that published
// before it failed reached the server: its closed connection is a new
// incident's, so the fresh tries start again (a relay behind drains without
// a pause, and no drain that succeeds would end the run between incidents).
func (r *Relay) drainFailed(published int, err error) time.Duration {
	if published > 0 {
		r.loop.db.lost = 0
	}
	if pgerr.ConnLost(err) && r.loop.db.lost < r.freshTries() {
		r.loop.db.lost++
		r.connLost(err)
		return time.Nanosecond
	}
	now := time.Now()
	r.loop.db.failures++
	if r.loop.db.failures == 1 {
		r.loop.db.downSince = now
	}
	d := retry.Backoff(r.loop.db.failures, drainRetryMin, drainRetryMax)
	r.loop.db.retryAt = now.Add(d)
	if r.loop.db.failures == 1 || now.Sub(r.loop.db.warned) >= drainWarnEvery {
		r.loop.db.warned = now
		r.log.Warn("drain failed; retrying", slog.Any("error", err), slog.Int("attempt", r.loop.db.failures),
			slog.Duration("retry_in", d), slog.Duration("failing_for", now.Sub(r.loop.db.downSince).Round(time.Millisecond)))
	} else {
		r.log.Debug("drain failed; retrying", slog.Any("error", err), slog.Int("attempt", r.loop.db.failures),
			slog.Duration("retry_in", d))
	}
	return d
}

// drainSucceeded notes the end of a run of failed drains.
func (r *Relay) drainSucceeded() {
	r.loop.db.lost = 0
	if r.loop.db.failures == 0 {
		return
	}
	r.log.Info("database reachable again; draining", slog.Int("failed_attempts", r.loop.db.failures),
		slog.Duration("down_for", time.Since(r.loop.db.downSince).Round(time.Millisecond)))
	r.loop.db.failures, r.loop.db.retryAt = 0, time.Time{}
	// If the LISTEN connection is waiting out its backoff, reconnect now:
	// until it is back, only this relay's poll finds new rows.
	select {
	case r.listener.now <- struct{}{}:
	default:
	}
}

// freshTries bounds the round trips tried again at once, in a row, because
// the server closed the pooled connection they ran on: each failed one takes
// a dead connection out of the pool, so one more than the pool holds reaches
// a fresh connection if the server is up.
func (r *Relay) freshTries() int { return int(r.pool.Config().MaxConns) + 1 }

// onFresh runs fn, and again at once while it fails on a pooled connection
// the server closed (freshTries at most). fn must be whole: one round trip
// or transaction built anew at each call.
func (r *Relay) onFresh(fn func() error) error {
	err := r.pool.roundTrip(fn)
	for i := 0; i < r.freshTries() && pgerr.ConnLost(err); i++ {
		r.connLost(err)
		err = r.pool.roundTrip(fn)
	}
	return err
}

// connLost logs a round trip tried again at once on a fresh connection.
func (r *Relay) connLost(err error) {
	r.log.Info("the server closed a pooled connection; trying again at once on a fresh one", slog.Any("error", err))
}
