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

// effects is anti-fraud's consumer.Handler: each event's effect is one call
// of effect.lua, a batch's calls in one pipeline (consumer.RunScripts).
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
	calls := make([]consumer.ScriptCall, len(b.Messages))
	keys := Keys{Prefix: b.Keys.Prefix}
	var order consumer.Order // a sender's later TEDs wait behind one that fails here
	// and, in the pipeline, behind one whose script fails (effect.lua's gate)
	batch := uuid.NewString()
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
		calls[i] = consumer.ScriptCall{Script: effectScript, Keys: e.effectKeys(keys, ev, batch), Args: e.effectArgs(keys, b.Fence, ev)}
	}
	// An event applied under an earlier number of partitions has its
	// marker under that layout's prefix (layouts.go).
	switch seen, err := e.appliedEarlier(ctx, evs); {
	case err != nil:
		for i := range calls {
			if calls[i].Script != nil {
				calls[i].Script, res[i].Err = nil, err
			}
		}
	default:
		for i, dup := range seen {
			if dup && calls[i].Script != nil {
				// Still through the script: fenced, and counted.
				calls[i].Args[len(calls[i].Args)-1] = "1"
			}
		}
	}
	replies, errs := consumer.RunScripts(ctx, e.rdb, b, calls,
		consumer.Replicas{Min: e.cfg.MinReplicas, Timeout: e.cfg.ReplicaTimeout})
	for i, call := range calls {
		if call.Script == nil {
			continue
		}
		if errs[i] != nil {
			res[i].Err = errs[i]
			continue
		}
		outcome, revised, err := effectResult(replies[i])
		if err != nil {
			res[i].Err = err
			continue
		}
		res[i].Outcome = outcome.String()
		e.applied(b.Messages[i], evs[i], outcome, revised)
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
