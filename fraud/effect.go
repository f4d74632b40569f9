package fraud

import (
	_ "embed"
	"errors"
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

func (c *Consumer) effectKeys(f feed, ev Event) []string {
	day, _ := Day(ev.SettledAt)
	k := f.keys
	return []string{
		k.Seen(ev.EventID.String()), k.Verdict(ev.TransferID.String()),
		k.DayAccount(day, ev.FromAccount), k.DayAccounts(day), k.Days(),
		k.Window(ev.FromAccount), k.Stats(), k.Alerts(), k.Lease(c.cfg.Group), k.Approved(ev.FromAccount),
		k.Audit(),
	}
}

func (c *Consumer) effectArgs(f feed, ev Event) []any {
	now := time.Now()
	day, dayNo := Day(ev.SettledAt)
	expireAt := DayExpiry(ev.SettledAt, c.cfg.Retention).UnixMilli()
	if expireAt <= now.UnixMilli() {
		expireAt = 0 // settled longer ago than the retention: keep no verdict or totals
	}
	_, oldest := Day(now.Add(-c.cfg.Retention))
	ms := func(v int64) string { return strconv.FormatInt(v, 10) }
	return []any{
		int64(c.cfg.DedupeTTL / time.Second),
		ev.EventID.String(),
		ev.TransferID.String(),
		ev.FromAccount,
		ms(ev.AmountCents),
		ms(ev.SettledAt.UnixMilli()),
		ms(c.cfg.Window.Milliseconds()),
		ms(c.cfg.AmountLimitCents),
		ms(c.cfg.WindowLimitCents),
		ev.ToAccount,
		ev.Currency,
		ms(expireAt),
		day,
		ms(dayNo),
		ms(oldest - 1),
		ms((c.cfg.DedupeTTL + 2*c.cfg.Window).Milliseconds()),
		ms(now.Add(-c.cfg.Retention).UnixMilli()),
		f.keys.Verdict(""),
		f.fence,
		c.cfg.AuditLen,
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

// errFenced: the effect script refused an effect because the partition's
// lease no longer holds this consumer's value.
var errFenced = errors.New("partition lease lost")
