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

// Handle applies the effect of each message of b, in order, in calls of
// effect.lua of up to effectsPerCall events each: the first call is sent as
// soon as it is full, and while Redis runs it Handle decodes the rest of the
// batch; once its reply is in, the other calls go in one pipeline, without
// the events of the senders whose event failed in the first (Handle holds
// them). Within that pipeline the script holds the rest: a sender's later
// events behind its failed one (the batch's gate), and every event of a call
// whose predecessor did not run (effect.lua, "Per-key order"). A pipeline
// ends at a call with an event that has no key (written before relays wrote
// one): its failure must hold every later event, which the gate cannot.
func (e *effects) Handle(ctx context.Context, b consumer.Batch) []consumer.Result {
	res := make([]consumer.Result, len(b.Messages))
	evs := make([]Event, len(b.Messages))
	keys := Keys{Prefix: b.Keys.Prefix}
	batch, now := uuid.NewString(), time.Now()
	var (
		order consumer.Order // a sender's later TEDs wait behind one that fails here
		calls []*effectCall  // the batch's calls, in order
		first *effectFlight  // the first call, sent while the others are built
	)
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
			if m.Key != "" && m.Key != ev.FromAccount && partition.Of(m.Key, e.cfg.Partitions) == b.Partition {
				// Routed by a key other than its sender, where this
				// consumer would route that key too: the writer chose the
				// key, and no configuration change will ever make the
				// entry applicable here.
				res[i].Err = consumer.Invalid("event %s of sender %s has partition_key %q: a transfer.settled event "+
					"must be keyed by its sender (from_account), as transfer.Settle and migration 0015 key it; "+
					"in the stream of partition %d its effects would land among another partition's senders",
					ev.EventID, ev.FromAccount, m.Key, b.Partition)
				order.Failed(m, res[i].Err)
				continue
			}
			// Its effects would land among another partition's keys: keep
			// it pending, loudly, until the configuration is fixed.
			res[i].Err = fmt.Errorf("event %s of sender %s is in the stream of partition %d, but of %d partitions the sender's is %d: "+
				"the relay and this consumer disagree on the number of partitions", ev.EventID, ev.FromAccount, b.Partition, e.cfg.Partitions, want)
			order.Failed(m, res[i].Err)
			continue
		}
		evs[i] = ev
		if len(calls) == 0 || len(calls[len(calls)-1].msgs) == effectsPerCall {
			calls = append(calls, e.newEffectCall(keys, batch, b.Fence, now))
		}
		call := calls[len(calls)-1]
		call.add(keys, ev, i, e.cfg.Retention, now)
		if first == nil && len(call.msgs) == effectsPerCall && i < len(b.Messages)-1 {
			call.numbered(1, 0, false)
			first = e.start(ctx, b, calls[:1], evs)
		}
	}
	rest, no := calls, 0 // the calls not sent, and how many were
	if first != nil {
		e.settle(b, first, evs, res, &order)
		rest, no = calls[1:], 1
	}
	for len(rest) > 0 {
		// The next pipeline, without the senders that failed by now (a
		// call that failed whole, an error before the script wrote the
		// gate, holds its senders' events in them too). It ends at a call
		// with an event that has no key: the script's gate holds senders,
		// and the failure of such an event must hold every later one
		// (consumer.Order), which only Handle can.
		var send []*effectCall
		for len(rest) > 0 {
			call := e.without(rest[0], &order, b, keys, batch, now, evs, res)
			rest = rest[1:]
			if call == nil {
				continue
			}
			send = append(send, call)
			if slices.ContainsFunc(call.msgs, func(i int) bool { return b.Messages[i].Key == "" }) {
				break
			}
		}
		for j, call := range send {
			follows := 0
			if j > 0 {
				follows = no + j
			}
			call.numbered(no+j+1, follows, j < len(send)-1)
		}
		if len(send) > 0 {
			e.settle(b, e.start(ctx, b, send, evs), evs, res, &order)
		}
		no += len(send)
	}
	return res
}

// effectFlight is a pipeline of calls of effect.lua that Redis runs: done
// is closed once their replies (or errors) are in.
type effectFlight struct {
	calls   []*effectCall
	done    chan struct{}
	replies []*redis.Cmd
	errs    []error
}

// start runs calls in one pipeline, on a goroutine of its own; settle
// waits for it.
func (e *effects) start(ctx context.Context, b consumer.Batch, calls []*effectCall, evs []Event) *effectFlight {
	f := &effectFlight{calls: calls, done: make(chan struct{})}
	go func() {
		defer close(f.done)
		// An event applied under an earlier number of partitions has its
		// marker under that layout's prefix (layouts.go): still through
		// the script, to be fenced and counted as a duplicate.
		var all []Event
		for _, call := range calls {
			for _, i := range call.msgs {
				all = append(all, evs[i])
			}
		}
		earlier, err := e.appliedEarlier(ctx, all)
		if err != nil {
			f.replies, f.errs = make([]*redis.Cmd, len(calls)), make([]error, len(calls))
			for i := range f.errs {
				f.errs[i] = err
			}
			return
		}
		if earlier != nil {
			k := 0
			for _, call := range calls {
				for j := range call.msgs {
					if earlier[k] {
						call.markEarlier(j)
					}
					k++
				}
			}
		}
		scripts := make([]consumer.ScriptCall, len(calls))
		for i, call := range calls {
			scripts[i] = consumer.ScriptCall{Script: effectScript, Keys: call.keys, Args: call.args}
		}
		f.replies, f.errs = consumer.RunScripts(ctx, e.rdb, b, scripts,
			consumer.Replicas{Min: e.cfg.MinReplicas, Timeout: e.cfg.ReplicaTimeout})
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
	for c, call := range f.calls {
		var out []effectReply
		err := f.errs[c]
		if err == nil {
			out, err = effectResults(f.replies[c], len(call.msgs))
		}
		for j, i := range call.msgs {
			switch {
			case err != nil: // the whole call: fenced, not run, or not confirmed by the replicas
				res[i].Err = err
				order.Failed(b.Messages[i], err)
			case redis.HasErrorPrefix(out[j].err, "HELD"): // by the batch's gate: not a failure of its own
				res[i] = consumer.Held(b.Messages[i])
				res[i].Err = fmt.Errorf("%w (%w)", res[i].Err, out[j].err)
				order.Failed(b.Messages[i], res[i].Err)
			case out[j].err != nil:
				res[i].Err = out[j].err
				order.Failed(b.Messages[i], out[j].err)
			default:
				res[i].Outcome = out[j].outcome.String()
				e.applied(b.Messages[i], evs[i], out[j].outcome, out[j].revised)
			}
		}
	}
}

// applied tells the observer and the logs of an effect applied or skipped.
func (e *effects) applied(m consumer.Message, ev Event, outcome Outcome, revised int64) {
	if e.cfg.Observer != nil {
		e.cfg.Observer.Processed(ev, outcome)
	}
	// A review is counted (outbox_fraud_events_processed_total{verdict})
	// and logged at DEBUG: under a burst, one INFO line per review was
	// nearly all of the log. A late arrival that revises verdicts is rare
	// and worth an INFO line.
	ctx := context.Background()
	if !(revised > 0 && e.log.Enabled(ctx, slog.LevelInfo)) && !(outcome == OutcomeReview && e.log.Enabled(ctx, slog.LevelDebug)) {
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
		log.Debug("transfer sent to review", slog.Int64("amount_cents", ev.AmountCents),
			slog.String("from_account", ev.FromAccount))
	}
}
