package fraud

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/redis/go-redis/v9"
)

// Report is the anti-fraud state: lifetime totals, printed by
// `outbox fraud report --json`.
type Report struct {
	Verdicts          int64                    `json:"verdicts"`           // effects applied
	Reviews           int64                    `json:"reviews"`            // of which sent to review
	DuplicatesSkipped int64                    `json:"duplicates_skipped"` // deliveries recognised as duplicates
	DeadLettered      int64                    `json:"dead_lettered"`      // entries moved to the dead-letter stream
	Accounts          map[string]AccountTotals `json:"accounts"`           // per sender account
}

// AccountTotals are a sender account's running totals.
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
	accounts, err := rdb.SMembers(ctx, keys.Accounts()).Result()
	if err != nil {
		return Report{}, fmt.Errorf("read accounts: %w", err)
	}
	const chunk = 1000
	for len(accounts) > 0 {
		batch := accounts[:min(chunk, len(accounts))]
		accounts = accounts[len(batch):]
		cmds := make([]*redis.MapStringStringCmd, len(batch))
		if _, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, a := range batch {
				cmds[i] = p.HGetAll(ctx, keys.Account(a))
			}
			return nil
		}); err != nil {
			return Report{}, fmt.Errorf("read account totals: %w", err)
		}
		for i, a := range batch {
			m := cmds[i].Val()
			rep.Accounts[a] = AccountTotals{SentCents: num(m, "sent_cents"), Transfers: num(m, "transfers")}
		}
	}
	return rep, nil
}

// Verdict returns the verdict recorded for a transfer ("approve" or "review"),
// or "" if there is none yet.
func Verdict(ctx context.Context, rdb redis.Cmdable, keyPrefix, transferID string) (string, error) {
	v, err := rdb.HGet(ctx, Keys{Prefix: keyPrefix}.Verdicts(), transferID).Result()
	if errors.Is(err, redis.Nil) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("read verdict: %w", err)
	}
	return v, nil
}
