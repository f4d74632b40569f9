package fraud

import (
	_ "embed"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// effectScript applies one event's effect with its dedupe marker, atomically.
var (
	//go:embed effect.lua
	effectSrc    string
	effectScript = redis.NewScript(effectSrc)
)

// effectKeys are the keys of ev's effect, among the partition's keys k.
func (e *effects) effectKeys(k Keys, ev Event, batch string) []string {
	day, _ := Day(ev.SettledAt)
	return []string{
		k.Seen(ev.EventID.String()), k.Verdict(ev.TransferID.String()),
		k.DayAccount(day, ev.FromAccount), k.DayAccounts(day), k.Days(),
		k.Window(ev.FromAccount), k.Stats(), k.Alerts(), k.Lease(e.cfg.Group), k.Approved(ev.FromAccount),
		k.Audit(), k.BatchGate(batch), k.WindowEntries(ev.FromAccount),
	}
}

// effectArgs are the arguments of ev's effect; fence is the partition's
// lease value it must find (consumer.Batch.Fence).
func (e *effects) effectArgs(k Keys, fence string, ev Event) []any {
	now := time.Now()
	day, dayNo := Day(ev.SettledAt)
	expireAt := DayExpiry(ev.SettledAt, e.cfg.Retention).UnixMilli()
	if expireAt <= now.UnixMilli() {
		expireAt = 0 // settled longer ago than the retention: keep no verdict or totals
	}
	_, oldest := Day(now.Add(-e.cfg.Retention))
	ms := func(v int64) string { return strconv.FormatInt(v, 10) }
	return []any{
		int64(e.cfg.DedupeTTL / time.Second),
		ev.EventID.String(),
		ev.TransferID.String(),
		ev.FromAccount,
		ms(ev.AmountCents),
		ms(ev.SettledAt.UnixMilli()),
		ms(e.cfg.Window.Milliseconds()),
		ms(e.cfg.AmountLimitCents),
		ms(e.cfg.WindowLimitCents),
		ev.ToAccount,
		ev.Currency,
		ms(expireAt),
		day,
		ms(dayNo),
		ms(oldest - 1),
		ms((e.cfg.DedupeTTL + 2*e.cfg.Window).Milliseconds()),
		ms(now.Add(-e.cfg.Retention).UnixMilli()),
		k.Verdict(""),
		fence,
		e.cfg.AuditLen,
		"0", // ARGV[21]: set to "1" by Handle when an earlier layout has the marker
	}
}

// effectResult reads effect.lua's reply: the outcome, and how many later
// transfers of the sender it sent to review.
func effectResult(cmd *redis.Cmd) (outcome Outcome, revised int64, err error) {
	vals, err := cmd.Int64Slice()
	if err != nil {
		return 0, 0, err
	}
	if len(vals) != 2 {
		return 0, 0, fmt.Errorf("effect script replied %v, want {outcome, revised}", vals)
	}
	return Outcome(vals[0]), vals[1], nil
}
