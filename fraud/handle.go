package fraud

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/partition"
)

// effects is anti-fraud's consumer.Handler: a batch's effects are calls of
// effect.lua of up to effectsPerCall events each, in one pipeline
// (consumer.RunScripts).
type effects struct {
	cfg     Config
	rdb     redis.Cmdable
	log     *slog.Logger
	layouts layouts // the group's earlier numbers of partitions (layouts.go)
}

// DedupeTTL is how long the dedupe markers live: consumer.New checks that
// they outlive every redelivery.
func (e *effects) DedupeTTL() time.Duration { return e.cfg.DedupeTTL }

// Handle applies the effect of each message of b.
func (e *effects) Handle(ctx context.Context, b consumer.Batch) []consumer.Result {
	res := make([]consumer.Result, len(b.Messages))
	evs := make([]Event, len(b.Messages))
	ok := make([]bool, len(b.Messages)) // decoded, and in the right partition
	var order consumer.Order            // a sender's later TEDs wait behind one that fails here
	// and, in the pipeline, behind one whose script fails (effect.lua's gate)
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
		evs[i], ok[i] = ev, true
	}
	// An event applied under an earlier number of partitions has its
	// marker under that layout's prefix (layouts.go).
	earlier, err := e.appliedEarlier(ctx, evs)
	if err != nil {
		for i := range ok {
			if ok[i] {
				ok[i], res[i].Err = false, err
			}
		}
	}
	keys := Keys{Prefix: b.Keys.Prefix}
	batch, now := uuid.NewString(), time.Now()
	var calls []*effectCall
	for i := range ok {
		if !ok[i] {
			continue
		}
		if len(calls) == 0 || len(calls[len(calls)-1].msgs) == effectsPerCall {
			calls = append(calls, e.newEffectCall(keys, batch, b.Fence, now))
		}
		calls[len(calls)-1].add(keys, evs[i], i, earlier != nil && earlier[i], e.cfg.Retention, now)
	}
	if len(calls) == 0 {
		return res
	}
	scripts := make([]consumer.ScriptCall, len(calls))
	for c, call := range calls {
		scripts[c] = consumer.ScriptCall{Script: effectScript, Keys: call.keys, Args: call.args}
	}
	replies, errs := consumer.RunScripts(ctx, e.rdb, b, scripts,
		consumer.Replicas{Min: e.cfg.MinReplicas, Timeout: e.cfg.ReplicaTimeout})
	for c, call := range calls {
		var out []effectReply
		err := errs[c]
		if err == nil {
			out, err = effectResults(replies[c], len(call.msgs))
		}
		for j, i := range call.msgs {
			switch {
			case err != nil: // the whole call: fenced, not run, or not confirmed by the replicas
				res[i].Err = err
			case out[j].err != nil:
				res[i].Err = out[j].err
			default:
				res[i].Outcome = out[j].outcome.String()
				e.applied(b.Messages[i], evs[i], out[j].outcome, out[j].revised)
			}
		}
	}
	return res
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
