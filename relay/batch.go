package relay

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/google/uuid"

	"github.com/tedbank/outbox/internal/failpoint"
	"github.com/tedbank/outbox/relay/broker"
)

// BatchResult says what one drained batch did (a test's single step,
// internal/relaytest.DrainBatch).
type BatchResult struct {
	Claimed    int   // rows claimed
	Published  int   // rows marked published
	Fenced     int   // rows published but no longer owned by this claim
	Failed     int   // rows that failed (retry later, or dead)
	Released   int   // rows given back without an attempt
	BrokerDown bool  // Redis refused the batch as a whole
	Err        error // the publish error behind Failed or BrokerDown, if any
	// RetryIn is how soon the earliest failed or released row becomes
	// claimable again (0 if none).
	RetryIn time.Duration
	// retries: how soon each failed or released row becomes claimable again
	// (distinct delays only).
	retries []time.Duration
	// Slept: the claim was preceded by outbox_relay_sleep, which found no
	// writer left that had seen the relay busy.
	Slept bool
}

// retryAfter notes a row that becomes claimable again after d.
func (res *BatchResult) retryAfter(d time.Duration) {
	if res.RetryIn == 0 || d < res.RetryIn {
		res.RetryIn = d
	}
	if !slices.Contains(res.retries, d) {
		res.retries = append(res.retries, d)
	}
}

// message is one claimed outbox row.
// message is a claimed row, as the broker publishes it.
type message = broker.Message

// stepDrainBatch claims one batch, publishes it and records the outcome. Once rows
// are claimed it finishes even if ctx is cancelled (bounded by the publish
// timeout), so a shutdown never strands a claim until the lease expires.
// With partition leases it first renews them when due (it must not be
// called while Run runs).
func (r *Relay) stepDrainBatch(ctx context.Context) (BatchResult, error) {
	if err := r.resolveOwnership(ctx); err != nil {
		return BatchResult{}, err
	}
	if l := r.own.leases; l != nil {
		if err := l.beforeBatch(ctx, nil); err != nil {
			return BatchResult{}, err
		}
	}
	res, _, err := r.drainBatch(ctx, flagNone, nil, false)
	return res, err
}

// drainBatch is stepDrainBatch with three more inputs: op is sent ahead of the
// claim; prev, if not nil, is marked in the claim's round trip and counted in
// the result; with deferMark, this batch's own mark of the published rows is
// returned for the next call instead of being sent.
func (r *Relay) drainBatch(ctx context.Context, op flagOp, prev *pendingMark, deferMark bool) (BatchResult, *pendingMark, error) {
	if l := r.own.leases; l != nil && prev != nil {
		// Partition leases send prev's mark beside this batch instead
		// (partitions.go).
		return l.drainBeside(ctx, prev, func() (BatchResult, *pendingMark, error) {
			return r.drainOne(ctx, op, nil, deferMark)
		})
	}
	return r.drainOne(ctx, op, prev, deferMark)
}

// drainOne is drainBatch with prev's mark, if any, in the claim's round trip.
func (r *Relay) drainOne(ctx context.Context, op flagOp, prev *pendingMark, deferMark bool) (BatchResult, *pendingMark, error) {
	if err := ctx.Err(); err != nil {
		return BatchResult{}, prev, err
	}
	// Past this point the batch is finished even if ctx is cancelled: a claim
	// interrupted after the server committed it would strand rows until the
	// lease expires. Every step has its own deadline instead.
	ctx = context.WithoutCancel(ctx)
	started := time.Now()
	token := uuid.New()
	cctx, cancel := context.WithTimeout(ctx, claimTimeout)
	defer cancel()
	msgs, prevMarked, slept, err := r.claim(cctx, op, token, prev)
	if err != nil {
		if prev != nil {
			// The mark rolled back with the claim; send it on its own, with
			// a deadline of its own (a hung statement or a half-open
			// connection must not freeze the relay).
			var res BatchResult
			mctx, cancel := context.WithTimeout(ctx, markTimeout)
			defer cancel()
			if merr := r.markPublished(mctx, &res, prev); merr != nil {
				err = errors.Join(err, merr)
			}
		}
		return BatchResult{}, nil, err
	}
	res := BatchResult{Slept: slept}
	if prev != nil {
		r.notePublished(&res, prev, prevMarked)
	}
	msgs, fence := r.own.admit(token, msgs)
	res.Claimed = len(msgs)
	if len(msgs) == 0 {
		return res, nil, nil
	}
	defer func() { r.cfg.Metrics.batch(res, time.Since(started)) }()
	r.stats.claimed.Add(int64(len(msgs)))
	if r.cfg.Observer != nil {
		r.cfg.Observer.Claimed(messageIDs(msgs))
	}
	failpoint.Inject("relay.after-claim")

	streams := make([]string, len(msgs))
	for i, m := range msgs {
		streams[i] = r.cfg.streamKey(m.AggregateType, m.PartitionKey)
	}
	pctx, cancel := context.WithTimeout(ctx, r.cfg.PublishTimeout)
	ids, errs := r.broker.Publish(pctx, msgs, streams)
	cancel()
	failpoint.Inject("relay.after-xadd")
	if pipelineDown(errs, streams) {
		// Every command failed the same way: the broker, not the events.
		for i := range errs {
			errs[i] = fmt.Errorf("%w: %w", errBrokerDown, errs[i])
		}
	}

	out := r.sortOutcome(&res, sent{msgs, streams, ids, errs, token, fence})
	if r.cfg.Observer != nil && len(out.ok.ids) > 0 {
		r.cfg.Observer.Published(out.ok.ids)
	}
	next, err := r.record(ctx, &res, &out, deferMark)
	r.stats.failed.Add(int64(res.Failed))
	r.stats.released.Add(int64(res.Released))
	return res, next, err
}

func messageIDs(msgs []message) []uuid.UUID {
	ids := make([]uuid.UUID, len(msgs))
	for i, m := range msgs {
		ids[i] = m.ID
	}
	return ids
}
