package fraud

import (
	_ "embed"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// effectScript applies the effects of a run of events, each atomically
// with its dedupe marker.
var (
	//go:embed effect.lua
	effectSrc    string
	effectScript = redis.NewScript(effectSrc)
)

// effectsPerCall is how many events one call of effect.lua applies at most:
// enough to spread what a call checks and writes once (the fence, the gate,
// the shared keys' types, the counters) over many events, few enough that a
// call holds Redis for a few milliseconds at most (a script blocks every
// other client while it runs; other clients' commands run between a batch's
// calls).
const effectsPerCall = 100

// effectCall is one call of effect.lua: its keys and arguments, and the
// batch's messages whose effects it applies, in order.
type effectCall struct {
	keys []string
	args []any
	msgs []int
}

// newEffectCall starts a call among the partition's keys k, in the batch's
// gate, fenced by the partition's lease value fence (consumer.Batch.Fence;
// empty: not fenced); add appends its events.
func (e *effects) newEffectCall(k Keys, batch, fence string, now time.Time) *effectCall {
	_, oldest := Day(now.Add(-e.cfg.Retention))
	ms := func(v int64) string { return strconv.FormatInt(v, 10) }
	return &effectCall{
		keys: []string{k.Days(), k.Stats(), k.Alerts(), k.Lease(e.cfg.Group), k.Audit(), k.BatchGate(batch)},
		args: []any{
			strconv.FormatInt(int64(e.cfg.DedupeTTL/time.Second), 10),
			ms(e.cfg.Window.Milliseconds()),
			ms(e.cfg.AmountLimitCents),
			ms(e.cfg.WindowLimitCents),
			ms(oldest - 1),
			ms((e.cfg.DedupeTTL + 2*e.cfg.Window).Milliseconds()),
			ms(now.Add(-e.cfg.Retention).UnixMilli()),
			k.Verdict(""),
			fence,
			strconv.Itoa(e.cfg.AuditLen),
			"1", "0", "0", // numbered when sent
		},
	}
}

// numbered says the call is the batch's no-th (from 1), sent in a pipeline
// after its call follows (0: first in its pipeline) and before another when
// more: a call runs only after the one before it in its pipeline ran
// (effect.lua).
func (c *effectCall) numbered(no, follows int, more bool) {
	c.args[10], c.args[11], c.args[12] = strconv.Itoa(no), strconv.Itoa(follows), "0"
	if more {
		c.args[12] = "1"
	}
}

// add appends the effect of ev, the batch's message msg.
func (c *effectCall) add(k Keys, ev Event, msg int, retention time.Duration, now time.Time) {
	day, dayNo := Day(ev.SettledAt)
	expireAt := DayExpiry(ev.SettledAt, retention).UnixMilli()
	if expireAt <= now.UnixMilli() {
		expireAt = 0 // settled longer ago than the retention: keep no verdict or totals
	}
	from, eventID, transferID := ev.FromAccount, ev.EventID.String(), ev.TransferID.String()
	c.keys = append(c.keys,
		k.Seen(eventID), k.Verdict(transferID), k.DayAccount(day, from), k.DayAccounts(day),
		k.Window(from), k.Approved(from), k.WindowEntries(from))
	c.args = append(c.args,
		eventID, transferID, from,
		strconv.FormatInt(ev.AmountCents, 10),
		strconv.FormatInt(ev.SettledAt.UnixMilli(), 10),
		ev.ToAccount, ev.Currency,
		strconv.FormatInt(expireAt, 10),
		day, strconv.FormatInt(dayNo, 10),
		"0")
	c.msgs = append(c.msgs, msg)
}

// markEarlier says the call's j-th event has its marker under an earlier
// number of partitions (layouts.go): a duplicate, still through the script
// to be fenced and counted.
func (c *effectCall) markEarlier(j int) {
	c.args[callArgs+eventArgs*(j+1)-1] = "1"
}

// How effect.lua's arguments and keys are laid out: the call's, then each
// event's.
const (
	callArgs  = 13
	eventArgs = 11
)

// effectReply is one event's part of effect.lua's reply.
type effectReply struct {
	outcome Outcome
	revised int64 // how many later transfers of the sender it sent to review
	err     error
}

// effectResults reads effect.lua's reply to a call of n events: one element
// per event, {outcome, revised} or the event's error.
func effectResults(cmd *redis.Cmd, n int) ([]effectReply, error) {
	vals, err := cmd.Slice()
	if err != nil {
		return nil, err
	}
	if len(vals) != n {
		return nil, fmt.Errorf("effect script replied %d elements for %d events", len(vals), n)
	}
	out := make([]effectReply, n)
	for i, v := range vals {
		switch v := v.(type) {
		case error:
			out[i].err = v
		case []any:
			outcome, ok1 := elemInt(v, 0)
			revised, ok2 := elemInt(v, 1)
			if len(v) != 2 || !ok1 || !ok2 {
				return nil, fmt.Errorf("effect script replied %v for event %d, want {outcome, revised}", v, i)
			}
			out[i] = effectReply{outcome: Outcome(outcome), revised: revised}
		default:
			return nil, fmt.Errorf("effect script replied %v (%T) for event %d, want {outcome, revised}", v, v, i)
		}
	}
	return out, nil
}

func elemInt(v []any, i int) (int64, bool) {
	if i >= len(v) {
		return 0, false
	}
	n, ok := v[i].(int64)
	return n, ok
}
