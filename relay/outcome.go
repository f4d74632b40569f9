package relay

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/google/uuid"

	"github.com/tedbank/outbox/internal/queries"
	"github.com/tedbank/outbox/internal/retry"
)

// sent is a batch after its publish round trip.
type sent struct {
	msgs    []message
	streams []string  // msgs[i] went to streams[i]
	ids     []string  // its stream entry id, if errs[i] is nil
	errs    []error   // why it was not published
	token   uuid.UUID // the claim's
	fence   fence     // what fences the batch's marks
}

// outcome is what a published batch leaves to record.
type outcome struct {
	ok         pendingMark // in the stream: mark published
	failed     pendingMark // refused one by one (streamIDs holds the errors): count an attempt
	failDelays []int64     // each failed row's backoff, in milliseconds
	token      uuid.UUID   // the claim's
	release    []uuid.UUID // the broker refused the batch as a whole: give back, no attempt counted
	maybeSent  []uuid.UUID // of those, the ones the broker may have taken (maybeSent): their redelivery window starts
}

// sortOutcome sorts each row of b by its publish result, counting failures
// and their retry delays in res.
func (r *Relay) sortOutcome(res *BatchResult, b sent) outcome {
	out := outcome{ok: pendingMark{fence: b.fence}, failed: pendingMark{fence: b.fence}, token: b.token}
	for i, m := range b.msgs {
		err := b.errs[i]
		switch {
		case err == nil:
			out.ok.add(i, m.ID, m.Seq, b.ids[i])
			r.cfg.Metrics.delay(time.Since(m.CreatedAt))
		case r.broker.Unavailable(err):
			res.BrokerDown = true
			res.Err = err
			out.release = append(out.release, m.ID)
			if r.broker.MaybeSent(err) {
				out.maybeSent = append(out.maybeSent, m.ID)
			}
		default:
			res.Err = err
			r.cfg.Metrics.failure(m.EventType)
			out.failed.add(i, m.ID, m.Seq, truncate(err.Error(), 1000))
			delay := retry.Backoff(m.Attempts+1, r.cfg.BackoffBase, r.cfg.BackoffMax)
			out.failDelays = append(out.failDelays, delay.Milliseconds())
			res.retryAfter(delay)
			r.log.Warn("publish failed", slog.String("event_id", m.ID.String()),
				slog.String("event_type", m.EventType), slog.String("aggregate_id", m.AggregateID),
				slog.Int("attempt", m.Attempts+1), slog.Int("max_attempts", r.cfg.MaxAttempts), slog.Any("error", err))
		}
	}
	return out
}

// record marks out's rows: published (or, with deferMark, returns that mark
// for the next claim's round trip), failed, and released. The marks are
// fenced by the claim token (with partition leases, by each row's lease
// token): a row another relay re-claimed after this relay's lease expired
// is left to that relay.
func (r *Relay) record(ctx context.Context, res *BatchResult, out *outcome, deferMark bool) (next *pendingMark, _ error) {
	ctx, cancel := context.WithTimeout(ctx, markTimeout)
	defer cancel()
	if len(out.ok.ids) > 0 {
		if deferMark {
			next = &out.ok
		} else if err := r.markPublished(ctx, res, &out.ok); err != nil {
			return nil, err
		}
	}
	if len(out.failed.ids) > 0 {
		n, err := r.markFailed(ctx, &out.failed, out.failDelays)
		if err != nil {
			return next, fmt.Errorf("record %d failed publishes: %w", len(out.failed.ids), err)
		}
		res.Failed = n
	}
	if len(out.release) == 0 {
		return next, nil
	}
	if len(out.maybeSent) > 0 {
		// Before the rows are given back: a crash in between leaves them
		// claimed and stamped, and the reaper keeps the stamp.
		if _, err := r.exec(ctx, queries.RelayMarkSent(out.maybeSent)); err != nil {
			return next, fmt.Errorf("start the redelivery window of %d rows the broker may have taken: %w", len(out.maybeSent), err)
		}
	}
	n, err := r.own.release(ctx, out.token, out.release, res.Err)
	if err != nil {
		return next, err
	}
	res.Released = n
	res.RetryIn = releaseDelay
	res.retries = append(res.retries, releaseDelay)
	return next, nil
}
