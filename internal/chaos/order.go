package chaos

import (
	"context"
	"slices"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/connect"
)

// checkOrder checks per-sender order from the consumers' own record: the
// audit streams, which the effect script appends to atomically with each
// effect, and the ledger's entries (the inbox path, ledger.go). Each
// sender's transfers must have been applied in settled (seq) order, each
// once. It returns how many senders' were not, on both paths.
func (r *run) checkOrder(ctx context.Context, verdicts int) int {
	want := map[string][]string{} // sender -> transfer ids in seq order
	rows, err := r.mon.Query(ctx, `SELECT aggregate_id, coalesce(partition_key, aggregate_id) FROM outbox_messages
		WHERE aggregate_type = 'transfer' AND event_type = 'transfer.settled' ORDER BY seq`)
	if err != nil {
		r.problem("read events in seq order: %v", err)
		return 0
	}
	for rows.Next() {
		var id, key string
		if err := rows.Scan(&id, &key); err != nil {
			r.problem("read events in seq order: %v", err)
			return 0
		}
		want[key] = append(want[key], id)
	}
	rows.Close()
	got := map[string][]string{}
	audited := 0
	for _, k := range r.fraudKeys().Each() {
		start := "-"
		for {
			msgs, err := r.rdb.XRangeN(ctx, k.Audit(), start, "+", 1000).Result()
			if err != nil {
				r.problem("read the audit stream %s: %v", k.Audit(), err)
				return 0
			}
			for _, m := range msgs {
				from, _ := m.Values["from_account"].(string)
				id, _ := m.Values["transfer_id"].(string)
				got[from] = append(got[from], id)
				audited++
			}
			if len(msgs) < 1000 {
				break
			}
			start = "(" + msgs[len(msgs)-1].ID
		}
	}
	if audited != verdicts {
		r.problem("the audit streams record %d effects for %d verdicts", audited, verdicts)
	}
	outOfOrder := 0
	for sender, ids := range want {
		if !slices.Equal(got[sender], ids) {
			outOfOrder++
			if outOfOrder <= 3 {
				g := got[sender]
				i := 0
				for i < min(len(g), len(ids)) && g[i] == ids[i] {
					i++
				}
				r.detail("sender %s: %d effects audited for %d transfers; from position %d applied %v, settled %v",
					sender, len(g), len(ids), i, g[i:min(len(g), i+3)], ids[i:min(len(ids), i+3)])
			}
		}
	}
	if outOfOrder > 0 {
		r.problem("%d senders' effects were not applied once each in settled order (audit streams)", outOfOrder)
	}
	return outOfOrder + r.checkLedger(ctx, want)
}

// verdicts reads every verdict key, by transfer id, with its expiry: each
// must expire with its day's totals (fraud.DayExpiry), never be kept
// forever.
func (r *run) verdicts(ctx context.Context) (map[string]string, error) {
	var names, ids []string
	for _, k := range r.fraudKeys().Each() {
		prefix := k.Verdict("")
		found, err := connect.Keys(ctx, r.rdb, prefix+"*")
		if err != nil {
			return nil, err
		}
		for _, name := range found {
			names, ids = append(names, name), append(ids, strings.TrimPrefix(name, prefix))
		}
	}
	out := make(map[string]string, len(names))
	unbounded := 0
	for from := 0; from < len(names); from += 1000 {
		chunk, chunkIDs := names[from:min(from+1000, len(names))], ids[from:min(from+1000, len(names))]
		vals := make([]*redis.StringCmd, len(chunk))
		ttls := make([]*redis.DurationCmd, len(chunk))
		if _, err := r.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, k := range chunk {
				vals[i], ttls[i] = p.Get(ctx, k), p.PTTL(ctx, k)
			}
			return nil
		}); err != nil {
			return nil, err
		}
		for i := range chunk {
			out[chunkIDs[i]] = vals[i].Val()
			if ttls[i].Val() < 0 {
				unbounded++
			}
		}
	}
	if unbounded > 0 {
		r.problem("%d verdict keys have no expiry", unbounded)
	}
	return out, nil
}

// ted is a transfer as PostgreSQL has it.
type ted struct {
	from   string
	amount int64
	at     time.Time
}

// verdictsDiffer applies anti-fraud's rule (the consumer's default limits,
// which the suite runs with) to every sender's transfers in settled order
// and counts the verdicts that differ from anti-fraud's: whatever order the
// faults delivered the events in, the verdicts must be these.
func verdictsDiffer(teds map[string]ted, verdicts map[string]string) (n int, example string) {
	type item struct {
		id     string
		at     int64 // ms, as the consumer scores it
		amount int64
	}
	bySender := map[string][]item{}
	for id, t := range teds {
		bySender[t.from] = append(bySender[t.from], item{id, t.at.UnixMilli(), t.amount})
	}
	window := fraud.DefaultWindow.Milliseconds()
	for _, items := range bySender {
		for _, it := range items {
			total := int64(0)
			for _, o := range items { // (at - window, at], ties included
				if o.at > it.at-window && o.at <= it.at {
					total += o.amount
				}
			}
			want := "approve"
			if it.amount > fraud.DefaultAmountLimitCents || total > fraud.DefaultWindowLimitCents {
				want = "review"
			}
			if got, ok := verdicts[it.id]; ok && got != want {
				n++
				example = it.id
			}
		}
	}
	return n, example
}
