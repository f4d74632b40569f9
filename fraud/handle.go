package fraud

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/partition"
)

// effects is anti-fraud's consumer.Handler: a batch's effects are calls of
// effect.lua of up to effectsPerCall events each (consumer.RunScripts).
type effects struct {
	cfg     Config
	rdb     redis.Cmdable
	log     *slog.Logger
	layouts layouts // the group's earlier numbers of partitions (layouts.go)
}

// DedupeTTL is how long the dedupe markers live: consumer.New checks that
// they outlive every redelivery.
func (e *effects) DedupeTTL() time.Duration { return e.cfg.DedupeTTL }

// Handle applies the effect of each message of b, in order: a call of
// effect.lua per effectsPerCall messages, one after another, each sent once
// the one before has replied (so that a sender's failed event in one holds
// its later ones in the next: Handle leaves them out, and the batch's gate
// refuses them). While Redis runs a call, Handle decodes the messages of the
// next.
func (e *effects) Handle(ctx context.Context, b consumer.Batch) []consumer.Result {
	res := make([]consumer.Result, len(b.Messages))
	evs := make([]Event, len(b.Messages))
	keys := Keys{Prefix: b.Keys.Prefix}
	batch, now := uuid.NewString(), time.Now()
	var (
		order  consumer.Order // a sender's later TEDs wait behind one that fails here
		call   *effectCall    // the call being filled
		flight *effectFlight  // the call Redis is running
	)
	send := func() {
		if flight != nil {
			e.settle(b, flight, evs, res, &order)
		}
		flight = nil
		if call != nil {
			// The call before may have failed whole (a broken connection,
			// an error before the script wrote the gate): its senders'
			// events in this one wait too.
			call = e.without(call, &order, b, keys, batch, now, evs, res)
		}
		if call != nil {
			flight = e.start(ctx, b, call, evs)
		}
		call = nil
	}
	for i, m := range b.Messages {
		if order.Holds(m) {
			res[i] = consumer.Held(m)
			continue
		}
		ev, err := decodeMessage(m)
		if err != nil {
			res[i].Err = err
			order.Failed(m, err)
			continue
		}
		if want := partition.Of(ev.FromAccount, e.cfg.Partitions); want != b.Partition {
			// Its effects would land among another partition's keys: keep
			// it pending, loudly, until the configuration is fixed.
			res[i].Err = fmt.Errorf("event %s of sender %s is in the stream of partition %d, but of %d partitions the sender's is %d: "+
				"the relay and this consumer disagree on the number of partitions", ev.EventID, ev.FromAccount, b.Partition, e.cfg.Partitions, want)
			order.Failed(m, res[i].Err)
			continue
		}
		evs[i] = ev
		if call == nil {
			call = e.newEffectCall(keys, batch, b.Fence, now)
		}
		call.add(keys, ev, i, e.cfg.Retention, now)
		if len(call.msgs) == effectsPerCall {
			send()
		}
	}
	send() // the last call
	send() // and its reply
	return res
}

// effectFlight is a call of effect.lua that Redis runs: done is closed
// once its reply (or error) is in.
type effectFlight struct {
	call  *effectCall
	done  chan struct{}
	reply *redis.Cmd
	err   error
}

// start runs call on a goroutine of its own; settle waits for it.
func (e *effects) start(ctx context.Context, b consumer.Batch, call *effectCall, evs []Event) *effectFlight {
	f := &effectFlight{call: call, done: make(chan struct{})}
	chunk := make([]Event, len(call.msgs))
	for j, i := range call.msgs {
		chunk[j] = evs[i]
	}
	go func() {
		defer close(f.done)
		// An event applied under an earlier number of partitions has its
		// marker under that layout's prefix (layouts.go): still through
		// the script, to be fenced and counted as a duplicate.
		earlier, err := e.appliedEarlier(ctx, chunk)
		if err != nil {
			f.err = err
			return
		}
		for j, dup := range earlier {
			if dup {
				call.markEarlier(j)
			}
		}
		replies, errs := consumer.RunScripts(ctx, e.rdb, b,
			[]consumer.ScriptCall{{Script: effectScript, Keys: call.keys, Args: call.args}},
			consumer.Replicas{Min: e.cfg.MinReplicas, Timeout: e.cfg.ReplicaTimeout})
		f.reply, f.err = replies[0], errs[0]
	}()
	return f
}

// without returns call without the messages order now holds, each held in
// res (nil: none left).
func (e *effects) without(call *effectCall, order *consumer.Order, b consumer.Batch, keys Keys, batch string,
	now time.Time, evs []Event, res []consumer.Result) *effectCall {
	if !slices.ContainsFunc(call.msgs, func(i int) bool { return order.Holds(b.Messages[i]) }) {
		return call
	}
	var kept *effectCall
	for _, i := range call.msgs {
		if m := b.Messages[i]; order.Holds(m) {
			res[i] = consumer.Held(m)
			continue
		}
		if kept == nil {
			kept = e.newEffectCall(keys, batch, b.Fence, now)
		}
		kept.add(keys, evs[i], i, e.cfg.Retention, now)
	}
	return kept
}

// settle waits for f and records its events' results in res, and their
// failures in order.
func (e *effects) settle(b consumer.Batch, f *effectFlight, evs []Event, res []consumer.Result, order *consumer.Order) {
	<-f.done
	var out []effectReply
	err := f.err
	if err == nil {
		out, err = effectResults(f.reply, len(f.call.msgs))
	}
	for j, i := range f.call.msgs {
		switch {
		case err != nil: // the whole call: fenced, not run, or not confirmed by the replicas
			res[i].Err = err
			order.Failed(b.Messages[i], err)
		case out[j].err != nil:
			res[i].Err = out[j].err
			order.Failed(b.Messages[i], out[j].err)
		default:
			res[i].Outcome = out[j].outcome.String()
			e.applied(b.Messages[i], evs[i], out[j].outcome, out[j].revised)
		}
	}
}

// applied tells the observer and the logs of an effect applied or skipped.
func (e *effects) applied(m consumer.Message, ev Event, outcome Outcome, revised int64) {
	if e.cfg.Observer != nil {
		e.cfg.Observer.Processed(ev, outcome)
	}
	if revised == 0 && outcome != OutcomeReview {
		return
	}
	log := e.log.With(slog.String("event_id", ev.EventID.String()),
		slog.String("event_type", m.Type),
		slog.String("aggregate_id", ev.TransferID.String()),
		slog.Int64("attempt", m.Attempt))
	if revised > 0 {
		log.Info("earlier transfer arrived late: later transfers of its sender sent to review",
			slog.Int64("revised", revised), slog.String("from_account", ev.FromAccount))
	}
	if outcome == OutcomeReview {
		log.Info("transfer sent to review", slog.Int64("amount_cents", ev.AmountCents),
			slog.String("from_account", ev.FromAccount))
	}
}
