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

// ReadReport reads the report from the keys of every partition of keys,
// summed.
func ReadReport(ctx context.Context, rdb redis.Cmdable, keys Keys) (Report, error) {
	rep := Report{Accounts: map[string]AccountTotals{}}
	for _, k := range keys.Each() {
		if err := readReport(ctx, rdb, k, &rep); err != nil {
			return Report{}, err
		}
	}
	return rep, nil
}

// readReport adds one partition's state to rep.
func readReport(ctx context.Context, rdb redis.Cmdable, keys Keys, rep *Report) error {
	stats, err := rdb.HGetAll(ctx, keys.Stats()).Result()
	if err != nil {
		return fmt.Errorf("read stats: %w", err)
	}
	num := func(m map[string]string, k string) int64 {
		v, _ := strconv.ParseInt(m[k], 10, 64)
		return v
	}
	rep.Verdicts += num(stats, "verdicts")
	rep.Reviews += num(stats, "reviews")
	rep.DuplicatesSkipped += num(stats, "duplicates_skipped")
	rep.DeadLettered += num(stats, "dead_lettered")
	days, err := rdb.ZRange(ctx, keys.Days(), 0, -1).Result()
	if err != nil {
		return fmt.Errorf("read the days index: %w", err)
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
			return fmt.Errorf("read the senders of each day: %w", err)
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
			return fmt.Errorf("read account totals: %w", err)
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
	return nil
}

// reportChunk is how many keys one pipelined round trip of ReadReport or
// ReadVerdicts reads.
const reportChunk = 1000

// Verdict returns the verdict recorded for a transfer ("approve" or "review"),
// or "" if there is none (not judged yet, or past the retention). With
// several partitions it looks in each; ReadVerdictsOf, given the sender,
// looks in one.
func Verdict(ctx context.Context, rdb redis.Cmdable, keys Keys, transferID string) (string, error) {
	vs, err := ReadVerdicts(ctx, rdb, keys, []string{transferID})
	if err != nil {
		return "", err
	}
	return vs[0], nil
}

// ReadVerdicts returns the verdicts of the transfers, in order ("" where
// there is none), in pipelined round trips, looking in every partition. A
// transfer judged before the verdicts got their own keys is found in the old
// Keys.Verdicts hash.
func ReadVerdicts(ctx context.Context, rdb redis.Cmdable, keys Keys, transferIDs []string) ([]string, error) {
	out := make([]string, len(transferIDs))
	for _, k := range keys.Each() {
		at := make([]int, 0, len(transferIDs))
		for i, v := range out {
			if v == "" {
				at = append(at, i)
			}
		}
		if err := readVerdicts(ctx, rdb, func(int) Keys { return k }, transferIDs, at, out); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// ReadVerdictsOf is ReadVerdicts for transfers whose senders are known
// (senders[i] sent transferIDs[i]): it reads each verdict in its sender's
// partition only.
func ReadVerdictsOf(ctx context.Context, rdb redis.Cmdable, keys Keys, transferIDs, senders []string) ([]string, error) {
	if len(senders) != len(transferIDs) {
		return nil, fmt.Errorf("read verdicts: %d transfers but %d senders", len(transferIDs), len(senders))
	}
	out := make([]string, len(transferIDs))
	at := make([]int, len(transferIDs))
	for i := range at {
		at[i] = i
	}
	return out, readVerdicts(ctx, rdb, func(i int) Keys { return keys.Sender(senders[i]) }, transferIDs, at, out)
}

// readVerdicts reads the verdicts of transferIDs[i] for i in at into out[i],
// from the keys keysOf(i).
func readVerdicts(ctx context.Context, rdb redis.Cmdable, keysOf func(i int) Keys, transferIDs []string, at []int, out []string) error {
	for batch := range slices.Chunk(at, reportChunk) {
		cmds := make([]*redis.StringCmd, len(batch))
		if _, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for j, i := range batch {
				cmds[j] = p.Get(ctx, keysOf(i).Verdict(transferIDs[i]))
			}
			return nil
		}); err != nil && !errors.Is(err, redis.Nil) {
			return fmt.Errorf("read verdicts: %w", err)
		}
		var missing []int
		for j, c := range cmds {
			if v, err := c.Result(); err == nil {
				out[batch[j]] = v
			} else if errors.Is(err, redis.Nil) {
				missing = append(missing, batch[j])
			} else {
				return fmt.Errorf("read verdict: %w", err)
			}
		}
		// Verdicts kept before the retention, in one hash per prefix.
		byHash := map[string][]int{}
		for _, i := range missing {
			h := keysOf(i).Verdicts()
			byHash[h] = append(byHash[h], i)
		}
		for h, is := range byHash {
			ids := make([]string, len(is))
			for j, i := range is {
				ids[j] = transferIDs[i]
			}
			old, err := rdb.HMGet(ctx, h, ids...).Result()
			if err != nil {
				return fmt.Errorf("read verdicts kept before the retention: %w", err)
			}
			for j, v := range old {
				if s, ok := v.(string); ok {
					out[is[j]] = s
				}
			}
		}
	}
	return nil
}
