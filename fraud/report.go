package fraud

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"

	"github.com/redis/go-redis/v9"
)

// Report is the anti-fraud state, printed by `outbox fraud report --json`:
// lifetime counters, and each sender's totals over the days still retained
// (Config.Retention).
type Report struct {
	Verdicts          int64                    `json:"verdicts"`           // effects applied
	Reviews           int64                    `json:"reviews"`            // of which sent to review
	DuplicatesSkipped int64                    `json:"duplicates_skipped"` // deliveries recognised as duplicates
	DeadLettered      int64                    `json:"dead_lettered"`      // entries moved to the dead-letter stream
	Accounts          map[string]AccountTotals `json:"accounts"`           // per sender account, over the retained days
}

// AccountTotals are a sender account's totals.
type AccountTotals struct {
	SentCents int64 `json:"sent_cents"`
	Transfers int64 `json:"transfers"`
}

// ReadReport reads the report from the keys under keyPrefix.
func ReadReport(ctx context.Context, rdb redis.Cmdable, keyPrefix string) (Report, error) {
	keys := Keys{Prefix: keyPrefix}
	stats, err := rdb.HGetAll(ctx, keys.Stats()).Result()
	if err != nil {
		return Report{}, fmt.Errorf("read stats: %w", err)
	}
	num := func(m map[string]string, k string) int64 {
		v, _ := strconv.ParseInt(m[k], 10, 64)
		return v
	}
	rep := Report{
		Verdicts:          num(stats, "verdicts"),
		Reviews:           num(stats, "reviews"),
		DuplicatesSkipped: num(stats, "duplicates_skipped"),
		DeadLettered:      num(stats, "dead_lettered"),
		Accounts:          map[string]AccountTotals{},
	}
	days, err := rdb.ZRange(ctx, keys.Days(), 0, -1).Result()
	if err != nil {
		return Report{}, fmt.Errorf("read the days index: %w", err)
	}
	type dayAccount struct{ day, acct string }
	var all []dayAccount
	for batch := range slices.Chunk(days, reportChunk) {
		cmds := make([]*redis.StringSliceCmd, len(batch))
		if _, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, d := range batch {
				cmds[i] = p.SMembers(ctx, keys.DayAccounts(d))
			}
			return nil
		}); err != nil {
			return Report{}, fmt.Errorf("read the senders of each day: %w", err)
		}
		for i, d := range batch {
			for _, a := range cmds[i].Val() {
				all = append(all, dayAccount{d, a})
			}
		}
	}
	for batch := range slices.Chunk(all, reportChunk) {
		cmds := make([]*redis.MapStringStringCmd, len(batch))
		if _, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, da := range batch {
				cmds[i] = p.HGetAll(ctx, keys.DayAccount(da.day, da.acct))
			}
			return nil
		}); err != nil {
			return Report{}, fmt.Errorf("read account totals: %w", err)
		}
		for i, da := range batch {
			m := cmds[i].Val()
			if len(m) == 0 {
				continue // expired between the reads
			}
			t := rep.Accounts[da.acct]
			t.SentCents += num(m, "sent_cents")
			t.Transfers += num(m, "transfers")
			rep.Accounts[da.acct] = t
		}
	}
	return rep, nil
}

// reportChunk is how many keys one pipelined round trip of ReadReport or
// ReadVerdicts reads.
const reportChunk = 1000

// Verdict returns the verdict recorded for a transfer ("approve" or "review"),
// or "" if there is none (not judged yet, or past the retention).
func Verdict(ctx context.Context, rdb redis.Cmdable, keyPrefix, transferID string) (string, error) {
	vs, err := ReadVerdicts(ctx, rdb, keyPrefix, []string{transferID})
	if err != nil {
		return "", err
	}
	return vs[0], nil
}

// ReadVerdicts returns the verdicts of the transfers, in order ("" where
// there is none), in pipelined round trips. A transfer judged before the
// verdicts got their own keys is found in the old Keys.Verdicts hash.
func ReadVerdicts(ctx context.Context, rdb redis.Cmdable, keyPrefix string, transferIDs []string) ([]string, error) {
	keys := Keys{Prefix: keyPrefix}
	out := make([]string, len(transferIDs))
	for from := 0; from < len(transferIDs); from += reportChunk {
		ids := transferIDs[from:min(from+reportChunk, len(transferIDs))]
		cmds := make([]*redis.StringCmd, len(ids))
		if _, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, id := range ids {
				cmds[i] = p.Get(ctx, keys.Verdict(id))
			}
			return nil
		}); err != nil && !errors.Is(err, redis.Nil) {
			return nil, fmt.Errorf("read verdicts: %w", err)
		}
		var missing []string
		var at []int
		for i, c := range cmds {
			if v, err := c.Result(); err == nil {
				out[from+i] = v
			} else if errors.Is(err, redis.Nil) {
				missing, at = append(missing, ids[i]), append(at, from+i)
			} else {
				return nil, fmt.Errorf("read verdict: %w", err)
			}
		}
		if len(missing) == 0 {
			continue
		}
		old, err := rdb.HMGet(ctx, keys.Verdicts(), missing...).Result()
		if err != nil {
			return nil, fmt.Errorf("read verdicts kept before the retention: %w", err)
		}
		for i, v := range old {
			if s, ok := v.(string); ok {
				out[at[i]] = s
			}
		}
	}
	return out, nil
}
