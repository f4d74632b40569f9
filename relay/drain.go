package relay

import (
	"context"
	"errors"
	"log/slog"
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
// left for the fallback poll (wakeup.go). A poll re-asserts "sleep" first, in
// case a relay that crashed while draining left writers silent.
func (r *Relay) drain(ctx context.Context, polled bool) (published int, err error) {
	if err := r.reclaimLeftovers(ctx); err != nil {
		return 0, err
	}
	if r.resync.Swap(false) {
		r.setState(unsure)
	}
	op := flagNone
	if polled {
		op = flagSleep
	}
	// A wake-up usually finds one small batch; saying "busy" and "asleep"
	// around it would cost two statements and buy nothing. Writers are told
	// to stop notifying only once a second claim in a row finds rows: the
	// relay is then draining a stream of commits.
	nonEmpty, lingered, sleepTries := 0, 0, 0
	// Redis refused the last batch as a whole: wait out the backoff before
	// the first claim, even if a notification woke this drain early, so that
	// an outage costs one publish round per backoff step, not one per commit.
	if wait := time.Until(r.brokerDownUntil); wait > 0 {
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
		if r.leaseRenewalDue() {
			// The last batch's mark goes first: a slot given back with
			// its mark unsent would leave its rows to be published twice.
			if err := flush(); err != nil {
				return published, err
			}
			r.renewLeasesIfDue(ctx)
		}
		var res BatchResult
		res, pending, err = r.drainBatch(ctx, op, pending, true)
		if err != nil {
			// The round trip may have told writers "busy" before it failed
			// (the flag is a sequence: its change is not rolled back), or a
			// later step failed after it did: they may be silent.
			r.setState(unsure)
		} else {
			r.setState(r.state.after(op, res.Slept))
		}
		now := time.Now()
		for _, d := range res.retries {
			r.retries.add(now.Add(d))
		}
		sent := op
		op = flagNone
		published += res.Published
		switch {
		case err != nil:
			return published, err
		case res.BrokerDown:
			if err := flush(); err != nil {
				return published, err
			}
			r.brokerFailures++
			d := retry.Backoff(r.brokerFailures, 100*time.Millisecond, 10*time.Second)
			r.brokerDownUntil = time.Now().Add(d)
			level := slog.LevelDebug
			if r.brokerFailures == 1 || r.brokerFailures%20 == 0 {
				level = slog.LevelWarn
			}
			r.log.Log(ctx, level, "redis unavailable; backing off", slog.Int("released", res.Released),
				slog.Int("attempt", r.brokerFailures), slog.Duration("retry_in", d), slog.Any("error", res.Err))
			retry.Sleep(ctx, d)
		case res.Claimed == 0 && r.state == asleep:
			return published, nil
		case res.Claimed == 0 && r.state == saidBusy && lingered < busyLingerClaims:
			// Busy, and the claim came back empty: commits arrive in waves
			// (one per WAL flush), so wait a little for the next one before
			// asking writers to notify again. Each NOTIFY costs its writer a
			// flush of its own.
			lingered++
			retry.Sleep(ctx, busyLingerStep)
		case res.Claimed == 0:
			if sent == flagSleep {
				// The sleep found writers that saw us busy still in their
				// transactions: try again a little later, or at once if a
				// notification comes (writers that read "sleep" send one).
				sleepTries++
				r.pause(ctx, retry.Backoff(sleepTries, busyLingerStep, 100*time.Millisecond))
			}
			op = flagSleep
		default:
			lingered = 0
			if r.brokerFailures > 0 {
				r.log.Info("redis available again; publishing", slog.Int("refused_rounds", r.brokerFailures))
			}
			r.brokerFailures, r.brokerDownUntil = 0, time.Time{} // Redis took this batch
			// "Busy" is said only with a LISTEN backend to say it as: the
			// other relays take it back if that backend goes.
			if nonEmpty++; r.state != saidBusy && nonEmpty >= 2 && r.listenPID.Load() != 0 {
				op = flagBusy
			}
			if r.state == saidBusy && r.cfg.BusyPace > 0 && res.Claimed < r.cfg.BatchSize/4 {
				// Busy with a stream of small batches: let commits gather
				// rather than pay a claim, a pipeline and a mark for a few
				// rows each time (on 2 cores that work competes with the
				// writers themselves).
				retry.Sleep(ctx, r.cfg.BusyPace)
			}
		}
	}
	return published, nil
}

// pause waits for d, or less if a notification arrives (it is consumed: the
// caller claims next).
func (r *Relay) pause(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	case <-r.wake:
	}
}

// A relay that told writers it is busy claims up to busyLingerClaims more
// times, busyLingerStep apart, before it goes back to sleep.
const (
	busyLingerClaims = 3
	busyLingerStep   = 2 * time.Millisecond
)
