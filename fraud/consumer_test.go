package fraud

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/internal/consumertest"
	"github.com/tedbank/outbox/internal/outboxtest"
)

func publish(t *testing.T, rdb outboxtest.Redis, stream, from string, cents int64, at time.Time) uuid.UUID {
	t.Helper()
	id, tid := uuid.New(), uuid.New()
	p, _ := json.Marshal(map[string]any{
		"schema_version": 1, "event_id": id, "transfer_id": tid, "from_account": from, "to_account": "dest",
		"amount_cents": cents, "currency": "BRL", "settled_at": at,
	})
	err := rdb.XAdd(context.Background(), &redis.XAddArgs{Stream: stream, Values: []any{
		"event_id", id.String(), "event_type", "transfer.settled", "aggregate_type", "transfer",
		"aggregate_id", tid.String(), "payload", string(p), "headers", "{}", "occurred_at", at.Format(time.RFC3339Nano),
		"partition_key", from, // as the relay writes it (transfer.Settle: the sender)
	}}).Err()
	if err != nil {
		t.Fatal(err)
	}
	return tid
}

// The velocity rule: one TED above the amount limit, or a sender whose total
// over the window passes the window limit, goes to review with an alert.
func TestVelocityRule(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	stream := rdb.Prefix + "outbox.event.transfer"
	c, err := New(rdb.Client, Config{Config: consumer.Config{Stream: stream, KeyPrefix: rdb.Prefix + "fraud:", Consumer: "c1"}, AmountLimitCents: 50_000, WindowLimitCents: 100_000, Window: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.EnsureGroup(ctx); err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC()
	cases := []struct {
		from  string
		cents int64
		at    time.Time
		want  string
	}{
		{"ana", 40_000, now.Add(-3 * time.Hour), "approve"}, // outside the window of the others
		{"ana", 40_000, now.Add(-30 * time.Minute), "approve"},
		{"ana", 40_000, now.Add(-10 * time.Minute), "approve"}, // 80k in the hour
		{"ana", 30_000, now, "review"},                         // 110k in the hour
		{"bia", 60_000, now, "review"},                         // one TED above the limit
		{"caio", 50_000, now, "approve"},                       // at the limit is fine
	}
	ids := make([]uuid.UUID, len(cases))
	for i, cs := range cases {
		ids[i] = publish(t, rdb, stream, cs.from, cs.cents, cs.at)
	}
	if _, err := consumertest.ReadNew(ctx, c.Consumer); err != nil {
		t.Fatal(err)
	}
	for i, cs := range cases {
		got, err := Verdict(ctx, rdb.Client, Keys{Prefix: rdb.Prefix + "fraud:"}, ids[i].String())
		if err != nil || got != cs.want {
			t.Errorf("case %d (%s %d): verdict %q (err %v), want %q", i, cs.from, cs.cents, got, err, cs.want)
		}
	}
	alerts, err := rdb.XRange(ctx, rdb.Prefix+"fraud:alerts", "-", "+").Result()
	if err != nil || len(alerts) != 2 {
		t.Fatalf("alerts %v (err %v), want 2", alerts, err)
	}
	if alerts[0].Values["reason"] != "velocity" || alerts[0].Values["window_total_cents"] != "110000" || alerts[1].Values["reason"] != "amount" {
		t.Fatalf("alerts %v", alerts)
	}
	rep, err := ReadReport(ctx, rdb.Client, Keys{Prefix: rdb.Prefix + "fraud:"})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Verdicts != 6 || rep.Reviews != 2 || rep.Accounts["ana"] != (AccountTotals{SentCents: 150_000, Transfers: 4}) {
		t.Fatalf("report %+v", rep)
	}
}

// windowConsumer returns a consumer c1 of its own stream and keys with a
// R$ 10.000 amount limit and a R$ 1.000 window limit over an hour, its group
// created.
func windowConsumer(t *testing.T, rdb outboxtest.Redis) (c *Consumer, stream string, keys Keys) {
	t.Helper()
	stream, keys = rdb.Prefix+"outbox.event.transfer", Keys{Prefix: rdb.Prefix + "fraud:"}
	c, err := New(rdb.Client, Config{Config: consumer.Config{Stream: stream, KeyPrefix: keys.Prefix, Consumer: "c1"}, AmountLimitCents: 1_000_000, WindowLimitCents: 100_000, Window: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.EnsureGroup(context.Background()); err != nil {
		t.Fatal(err)
	}
	return c, stream, keys
}

// TEDs settled at one instant (a payroll in one transaction) share one
// window total, that of the instant: the TED that takes it over the limit
// goes to review and sends the instant's earlier ones there too, and each
// later total counts them all, also once the running sum has more digits
// than the first's (the window's members of one instant sort by arrival,
// not by their text; sorted by text, the newest member would be the 90,000
// one and the eighth TED's total 15,000). A ninth TED of the instant that
// arrives late joins them in its place.
func TestTransfersOfOneInstantShareItsTotal(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	c, stream, keys := windowConsumer(t, rdb)
	at := time.Now().UTC().Add(-time.Minute).Truncate(time.Millisecond)
	var ids []uuid.UUID
	for range 8 { // R$ 150 each: 105k with the seventh, 120k with the eighth
		ids = append(ids, publish(t, rdb, stream, "ana", 15_000, at))
	}
	ids = append(ids, publish(t, rdb, stream, "ana", 1, at.Add(time.Second)))
	ids = append(ids, publish(t, rdb, stream, "ana", 15_000, at))               // late: 135k
	ids = append(ids, publish(t, rdb, stream, "ana", 1, at.Add(2*time.Second))) // 135,002
	if _, err := consumertest.ReadNew(ctx, c.Consumer); err != nil {
		t.Fatal(err)
	}
	for i, id := range ids {
		if got, err := Verdict(ctx, rdb.Client, keys, id.String()); err != nil || got != "review" {
			t.Errorf("TED %d: verdict %q (err %v), want review", i, got, err)
		}
	}
	alerts, err := rdb.XRange(ctx, keys.Alerts(), "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	var totals []string
	for _, a := range alerts {
		totals = append(totals, fmt.Sprint(a.Values["window_total_cents"]))
	}
	// The seventh's and the six it revised, the eighth's, the next
	// instant's, the late one's, the last one's.
	want := []string{"105000", "105000", "105000", "105000", "105000", "105000", "105000", "120000", "120001", "135000", "135002"}
	if !slices.Equal(totals, want) {
		t.Errorf("alerts' window totals %v, want %v", totals, want)
	}
}

// The verdicts do not depend on the order in which a sender's transfers
// arrive: three R$ 400 TEDs of one sender in an hour, with a R$ 1.000 window
// limit, give approve, approve, review in settled order, and the same when
// they arrive reversed or in any other order (the case: reversed,
// they used to give approve three times). A late arrival sends the later
// transfer it pushes over the limit to review, with one alert.
func TestVelocityVerdictsDoNotDependOnArrivalOrder(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	base := time.Now().UTC().Add(-time.Hour)
	type ted struct {
		from  string
		cents int64
		at    time.Time
	}
	teds := []ted{ // settled order
		{"ana", 40_000, base},
		{"ana", 40_000, base.Add(20 * time.Minute)},
		{"ana", 40_000, base.Add(40 * time.Minute)},             // 120k in the hour: review
		{"ana", 10_000, base.Add(90 * time.Minute)},             // 50k in its hour
		{"bia", 90_000, base.Add(10 * time.Minute)},             // alone
		{"bia", 20_000, base.Add(30 * time.Minute)},             // 110k: review
		{"ana", 30_000, base.Add(95 * time.Minute)},             // 80k in its hour
		{"ana", 25_000, base.Add(99*time.Minute + time.Second)}, // 105k: review
		// Settled at one instant (one transaction): each one's window
		// holds all three, 120k: all three go to review, whatever
		// order they arrive in.
		{"caio", 40_000, base.Add(50 * time.Minute)},
		{"caio", 40_000, base.Add(50 * time.Minute)},
		{"caio", 40_000, base.Add(50 * time.Minute)},
	}
	want := []string{"approve", "approve", "review", "approve", "approve", "review", "approve", "review", "review", "review", "review"}
	inOrder := make([]int, len(teds))
	for i := range inOrder {
		inOrder[i] = i
	}
	reversed := slices.Clone(inOrder)
	slices.Reverse(reversed)
	orders := [][]int{inOrder, reversed}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 8 {
		orders = append(orders, rng.Perm(len(teds)))
	}
	for n, order := range orders {
		prefix := fmt.Sprintf("%sorder%d:", rdb.Prefix, n)
		stream := prefix + "outbox.event.transfer"
		c, err := New(rdb.Client, Config{Config: consumer.Config{Stream: stream, KeyPrefix: prefix + "fraud:", Consumer: "c1"}, AmountLimitCents: 1_000_000, WindowLimitCents: 100_000, Window: time.Hour})
		if err != nil {
			t.Fatal(err)
		}
		if err := c.EnsureGroup(ctx); err != nil {
			t.Fatal(err)
		}
		ids := make([]uuid.UUID, len(teds))
		for _, i := range order {
			ids[i] = publish(t, rdb, stream, teds[i].from, teds[i].cents, teds[i].at)
			if _, err := consumertest.ReadNew(ctx, c.Consumer); err != nil { // one at a time, in this order
				t.Fatal(err)
			}
		}
		var got []string
		for i := range teds {
			v, err := Verdict(ctx, rdb.Client, Keys{Prefix: prefix + "fraud:"}, ids[i].String())
			if err != nil {
				t.Fatal(err)
			}
			got = append(got, v)
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("arrival order %v: verdicts %v, want %v (settled order's)", order, got, want)
		}
		alerts, err := rdb.XRange(ctx, prefix+"fraud:alerts", "-", "+").Result()
		if err != nil {
			t.Fatal(err)
		}
		rep, err := ReadReport(ctx, rdb.Client, Keys{Prefix: prefix + "fraud:"})
		if err != nil {
			t.Fatal(err)
		}
		if len(alerts) != 6 || rep.Reviews != 6 || rep.Verdicts != int64(len(teds)) {
			t.Errorf("arrival order %v: %d alerts, %d reviews counted, %d effects; want 6, 6, %d", order, len(alerts), rep.Reviews, rep.Verdicts, len(teds))
		}
	}
}

// The velocity rule against a model of it, over many arrival orders: each
// transfer's verdict is review when its amount passes the amount limit or
// when its sender's transfers settled in (its settled_at - window, its
// settled_at] add up past the window limit (those settled at its very
// instant included, as one transaction's), whatever order they arrive in,
// one at a time or many to a pipeline. Settlement instants repeat often
// (a minute's granularity), as a payroll's do.
func TestVelocityVerdictsMatchTheRuleInAnyArrivalOrder(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	const (
		window      = time.Hour
		windowLimit = 100_000
		amountLimit = 35_000
	)
	base := time.Now().UTC().Add(-3 * time.Hour).Truncate(time.Minute)
	rng := rand.New(rand.NewPCG(7, 11))
	for trial := range 6 {
		type ted struct {
			from  string
			cents int64
			at    time.Time
		}
		teds := make([]ted, 90)
		for i := range teds {
			// Within two windows: the script forgets what is older
			// than its newest transfer minus two windows.
			teds[i] = ted{fmt.Sprintf("s%d", rng.IntN(3)), 1_000 + rng.Int64N(39_000), base.Add(time.Duration(rng.IntN(110)) * time.Minute)}
		}
		want := make([]string, len(teds))
		reviews := 0
		for i, a := range teds {
			var total int64
			for _, b := range teds {
				if b.from == a.from && b.at.After(a.at.Add(-window)) && !b.at.After(a.at) {
					total += b.cents
				}
			}
			want[i] = "approve"
			if a.cents > amountLimit || total > windowLimit {
				want[i] = "review"
				reviews++
			}
		}
		prefix := fmt.Sprintf("%strial%d:", rdb.Prefix, trial)
		stream := prefix + "outbox.event.transfer"
		c, err := New(rdb.Client, Config{Config: consumer.Config{Stream: stream, KeyPrefix: prefix + "fraud:", Consumer: "c1"}, AmountLimitCents: amountLimit, WindowLimitCents: windowLimit, Window: window})
		if err != nil {
			t.Fatal(err)
		}
		if err := c.EnsureGroup(ctx); err != nil {
			t.Fatal(err)
		}
		order := rng.Perm(len(teds))
		if trial == 0 { // in settled order, the usual case
			slices.SortFunc(order, func(i, j int) int { return teds[i].at.Compare(teds[j].at) })
		}
		ids := make([]uuid.UUID, len(teds))
		for len(order) > 0 {
			n := min(len(order), 1+rng.IntN(12)) // a read of n entries: one pipeline
			for _, i := range order[:n] {
				ids[i] = publish(t, rdb, stream, teds[i].from, teds[i].cents, teds[i].at)
			}
			order = order[n:]
			if got, err := consumertest.ReadNew(ctx, c.Consumer); err != nil || got != n {
				t.Fatalf("read %d of %d entries: %v", got, n, err)
			}
		}
		for i := range teds {
			v, err := Verdict(ctx, rdb.Client, Keys{Prefix: prefix + "fraud:"}, ids[i].String())
			if err != nil {
				t.Fatal(err)
			}
			if v != want[i] {
				t.Errorf("trial %d: transfer %d (%s, %d cents at %s): verdict %q, want %q",
					trial, i, teds[i].from, teds[i].cents, teds[i].at.Sub(base), v, want[i])
			}
		}
		rep, err := ReadReport(ctx, rdb.Client, Keys{Prefix: prefix + "fraud:"})
		if err != nil {
			t.Fatal(err)
		}
		if rep.Reviews != int64(reviews) || rep.Verdicts != int64(len(teds)) {
			t.Errorf("trial %d: %d reviews counted of %d effects; want %d of %d", trial, rep.Reviews, rep.Verdicts, reviews, len(teds))
		}
	}
}

// windowMember matches a member of a sender's window as effect.lua writes
// it: settled_at|tie|cum|amount|flag|event_id|transfer_id.
var windowMember = regexp.MustCompile(`^\d+\|\d{8}\|-?\d+\|\d+\|[ar]\|[0-9a-f-]{36}\|[0-9a-f-]{36}$`)

// A sender's window of an earlier format is converted at its next event,
// and counts as it did: its transfers are in the next one's total, and a
// late arrival still sends one of them to review. The formats: members
// 'amount:event_id:transfer_id' (before the window entries), and numbered
// members with their entries in a hash and the approved ones in a second
// sorted set (the layout before the current one).
func TestWindowOfTheEarlierFormatIsConverted(t *testing.T) {
	for _, numbered := range []bool{false, true} {
		name := "amount members"
		if numbered {
			name = "numbered members with entries"
		}
		t.Run(name, func(t *testing.T) { testWindowConversion(t, numbered) })
	}
}

func testWindowConversion(t *testing.T, numbered bool) {
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	c, stream, keys := windowConsumer(t, rdb)
	base := time.Now().UTC().Add(-2 * time.Hour)
	var earlier []string // transfer ids
	for i, at := range []time.Time{base, base.Add(20 * time.Minute)} {
		tid, eid := uuid.NewString(), uuid.NewString()
		member := fmt.Sprintf("40000:%s:%s", eid, tid)
		if numbered {
			member = fmt.Sprintf("%015d", i+1)
			entry := fmt.Sprintf("%d:40000:%s:%s", 40000*(i+1), eid, tid)
			if err := rdb.HSet(ctx, keys.WindowEntries("ana"), member, entry, "n", i+1).Err(); err != nil {
				t.Fatal(err)
			}
		}
		score := float64(at.UnixMilli())
		if err := rdb.ZAdd(ctx, keys.Window("ana"), redis.Z{Score: score, Member: member}).Err(); err != nil {
			t.Fatal(err)
		}
		if err := rdb.ZAdd(ctx, keys.Approved("ana"), redis.Z{Score: score, Member: member}).Err(); err != nil {
			t.Fatal(err)
		}
		if err := rdb.Set(ctx, keys.Verdict(tid), "approve", time.Hour).Err(); err != nil {
			t.Fatal(err)
		}
		earlier = append(earlier, tid)
	}
	next := publish(t, rdb, stream, "ana", 30_000, base.Add(40*time.Minute)) // 110k in its hour
	late := publish(t, rdb, stream, "ana", 25_000, base.Add(10*time.Minute)) // 105k in the 20-minute one's
	if _, err := consumertest.ReadNew(ctx, c.Consumer); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		what, id, want string
		event          bool
	}{
		{"the earlier first", earlier[0], "approve", false},
		{"the earlier second, pushed over by the late arrival", earlier[1], "review", false},
		{"the next", next.String(), "review", true},
		{"the late arrival", late.String(), "approve", true},
	} {
		var (
			got string
			err error
		)
		if tc.event {
			got, err = Verdict(ctx, rdb.Client, keys, tc.id)
		} else {
			got, err = rdb.Get(ctx, keys.Verdict(tc.id)).Result()
		}
		if err != nil || got != tc.want {
			t.Errorf("%s: verdict %q (err %v), want %q", tc.what, got, err, tc.want)
		}
	}
	members, err := rdb.ZRange(ctx, keys.Window("ana"), 0, -1).Result()
	if err != nil || len(members) != 4 {
		t.Fatalf("window after the conversion: %v (err %v), want four members", members, err)
	}
	// In settled order: 40k, the late 25k, 40k (sent to review), 30k.
	for i, want := range []string{"|40000|40000|a|", "|65000|25000|a|", "|105000|40000|r|", "|135000|30000|r|"} {
		if !windowMember.MatchString(members[i]) || !strings.Contains(members[i], want) {
			t.Errorf("window member %d after the conversion: %s, want one of this format with %s", i, members[i], want)
		}
	}
	if n, err := rdb.Exists(ctx, keys.Approved("ana"), keys.WindowEntries("ana")).Result(); err != nil || n != 0 {
		t.Errorf("%d keys of the earlier format left (err %v), want 0", n, err)
	}
}

// A sender's window keeps its transfers of the last two windows before its
// newest one, and the window entries keep exactly those.
func TestWindowIsTrimmedToTwoWindows(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	stream := rdb.Prefix + "outbox.event.transfer"
	keys := Keys{Prefix: rdb.Prefix + "fraud:"}
	c, err := New(rdb.Client, Config{Config: consumer.Config{Stream: stream, KeyPrefix: keys.Prefix, Consumer: "c1"}, Window: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.EnsureGroup(ctx); err != nil {
		t.Fatal(err)
	}
	base := time.Now().UTC().Add(-5 * time.Hour)
	for _, h := range []int{0, 1, 2, 3, 4} { // hours after base
		publish(t, rdb, stream, "ana", 1_000, base.Add(time.Duration(h)*time.Hour))
		if _, err := consumertest.ReadNew(ctx, c.Consumer); err != nil {
			t.Fatal(err)
		}
	}
	scores, err := rdb.ZRangeWithScores(ctx, keys.Window("ana"), 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	var hours []int
	for _, z := range scores {
		hours = append(hours, int(time.UnixMilli(int64(z.Score)).Sub(base).Round(time.Minute).Hours()))
	}
	if !slices.Equal(hours, []int{2, 3, 4}) {
		t.Fatalf("window holds the transfers of hours %v after the first, want 2, 3, 4 (two windows before the newest)", hours)
	}
	// The running sums stay those of the whole sequence: a total is the
	// difference of two of them.
	for i, z := range scores {
		if m := fmt.Sprint(z.Member); !windowMember.MatchString(m) || !strings.Contains(m, fmt.Sprintf("|%d|1000|a|", 1000*(i+3))) {
			t.Errorf("window member %s, want the running sum %d", m, 1000*(i+3))
		}
	}
}

// A key of the wrong type that an effect writes after its first
// non-idempotent write would leave half an effect behind, and the retry once
// the key is fixed would count the transfer twice. Each such key is checked
// before the first write: the event fails whole, and applies once when the
// key is fixed. (The approved set went unchecked before: the window kept the
// failed attempt's entry and counted the transfer twice.)
func TestEffectOnAKeyOfTheWrongTypeLeavesNoHalfEffect(t *testing.T) {
	ctx := context.Background()
	now := time.Now().UTC()
	day, _ := Day(now)
	for _, tc := range []struct {
		name  string
		key   func(Keys) string
		cents int64 // over the amount limit: review
		audit int
		ago   time.Duration // the first TED's settlement before the second's
	}{
		{"stats", Keys.Stats, 100, 0, time.Minute},
		{"day totals", func(k Keys) string { return k.DayAccount(day, "ana") }, 100, 0, time.Minute},
		{"alerts", Keys.Alerts, DefaultAmountLimitCents + 1, 0, time.Minute},
		{"audit", Keys.Audit, 100, 10, time.Minute},
		// Read first, or written before the window (idempotent writes).
		{"window", func(k Keys) string { return k.Window("ana") }, 100, 0, time.Minute},
		{"window, trimmed", func(k Keys) string { return k.Window("ana") }, DefaultAmountLimitCents + 1, 0, 3 * DefaultWindow},
		{"day senders", func(k Keys) string { return k.DayAccounts(day) }, 100, 0, time.Minute},
		{"days index", Keys.Days, 100, 0, time.Minute},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rdb := outboxtest.NewRedis(t)
			cfg := Config{Config: consumer.Config{Stream: rdb.Prefix + "outbox.event.transfer", KeyPrefix: rdb.Prefix + "fraud:"}, AuditLen: tc.audit}.withDefaults()
			e := &effects{cfg: cfg, rdb: rdb.Client, log: cfg.Logger}
			keys := Keys{Prefix: cfg.KeyPrefix}
			publish(t, rdb, cfg.Stream, "ana", 100, now.Add(-tc.ago)) // a window to join
			publish(t, rdb, cfg.Stream, "ana", tc.cents, now)
			batches := entryBatches(t, rdb, cfg, 2)
			if res := e.Handle(ctx, batches[0]); res[0].Err != nil {
				t.Fatalf("first TED: %v", res[0].Err)
			}
			broken := tc.key(keys)
			saved, err := rdb.Dump(ctx, broken).Result()
			if err != nil && !errors.Is(err, redis.Nil) {
				t.Fatal(err)
			}
			if err := rdb.Del(ctx, broken).Err(); err != nil {
				t.Fatal(err)
			}
			if err := rdb.Set(ctx, broken, "not a "+tc.name, time.Minute).Err(); err != nil {
				t.Fatal(err)
			}
			if res := e.Handle(ctx, batches[1]); res[0].Err == nil || !strings.Contains(res[0].Err.Error(), "WRONGTYPE") {
				t.Fatalf("second TED with %s of the wrong type: %+v, want WRONGTYPE", broken, res[0])
			}
			if err := rdb.Del(ctx, broken).Err(); err != nil {
				t.Fatal(err)
			}
			if saved != "" {
				if err := rdb.Restore(ctx, broken, 0, saved).Err(); err != nil {
					t.Fatal(err)
				}
			}
			if res := e.Handle(ctx, batches[1]); res[0].Err != nil {
				t.Fatalf("second TED once %s is fixed: %v", broken, res[0].Err)
			}
			want := int64(2)
			if tc.ago > 2*DefaultWindow {
				want = 1 // the first trimmed
			}
			if n, err := rdb.ZCard(ctx, keys.Window("ana")).Result(); err != nil || n != want {
				t.Errorf("ana's window holds %d transfers (%v), want %d: the failed attempt left part of its effect", n, err, want)
			}
			if tc.name == "stats" || tc.name == "day totals" {
				return // restored without the failed attempt's counts, if it made any
			}
			rep, err := ReadReport(ctx, rdb.Client, keys)
			if err != nil {
				t.Fatal(err)
			}
			if rep.Verdicts != 2 || rep.Accounts["ana"].Transfers != 2 {
				t.Errorf("report %+v, want 2 verdicts and 2 transfers of ana", rep)
			}
		})
	}
}

// A transfer that sends an earlier-arrived one to review reads that one's
// verdict before it writes anything: a verdict key of the wrong type fails
// the event whole, and once fixed the event applies once and revises it.
func TestRevisionOfAVerdictOfTheWrongTypeLeavesNoHalfEffect(t *testing.T) {
	ctx := context.Background()
	rdb := outboxtest.NewRedis(t)
	cfg := Config{Config: consumer.Config{Stream: rdb.Prefix + "outbox.event.transfer", KeyPrefix: rdb.Prefix + "fraud:"}, WindowLimitCents: 150}.withDefaults()
	e := &effects{cfg: cfg, rdb: rdb.Client, log: cfg.Logger}
	keys := Keys{Prefix: cfg.KeyPrefix}
	at := time.Now().UTC()
	first := publish(t, rdb, cfg.Stream, "ana", 100, at)
	publish(t, rdb, cfg.Stream, "ana", 100, at) // the same instant: 200 over 150, both to review
	batches := entryBatches(t, rdb, cfg, 2)
	if res := e.Handle(ctx, batches[0]); res[0].Err != nil || res[0].Outcome != "approve" {
		t.Fatalf("first TED: %+v, want approve", res[0])
	}
	verdict := keys.Verdict(first.String())
	if err := rdb.Del(ctx, verdict).Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.HSet(ctx, verdict, "not", "a string").Err(); err != nil {
		t.Fatal(err)
	}
	if res := e.Handle(ctx, batches[1]); res[0].Err == nil || !strings.Contains(res[0].Err.Error(), "WRONGTYPE") {
		t.Fatalf("second TED with the first's verdict of the wrong type: %+v, want WRONGTYPE", res[0])
	}
	if err := rdb.Del(ctx, verdict).Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.Set(ctx, verdict, "approve", time.Hour).Err(); err != nil {
		t.Fatal(err)
	}
	if res := e.Handle(ctx, batches[1]); res[0].Err != nil || res[0].Outcome != "review" {
		t.Fatalf("second TED once fixed: %+v, want review", res[0])
	}
	if n, err := rdb.ZCard(ctx, keys.Window("ana")).Result(); err != nil || n != 2 {
		t.Errorf("ana's window holds %d transfers (%v), want 2: the failed attempt left part of its effect", n, err)
	}
	if v, err := rdb.Get(ctx, verdict).Result(); err != nil || v != "review" {
		t.Errorf("first TED's verdict %q (%v), want review (revised)", v, err)
	}
	rep, err := ReadReport(ctx, rdb.Client, keys)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Verdicts != 2 || rep.Reviews != 2 {
		t.Errorf("report %+v, want 2 verdicts, 2 reviews", rep)
	}
}

// entryBatches returns a batch of one message for each of the n entries of
// cfg's stream, in order, as the consumer hands them to the effect.
func entryBatches(t *testing.T, rdb outboxtest.Redis, cfg Config, n int) []consumer.Batch {
	t.Helper()
	x, err := rdb.XRange(context.Background(), cfg.Stream, "-", "+").Result()
	if err != nil || len(x) != n {
		t.Fatalf("entries %v (%v), want %d", x, err, n)
	}
	var out []consumer.Batch
	for _, entry := range x {
		m, err := consumer.DecodeEntry(entry.ID, entry.Values)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, consumer.Batch{Stream: cfg.Stream, Keys: consumer.Keys{Prefix: cfg.KeyPrefix}, Group: cfg.Group, Messages: []consumer.Message{m}})
	}
	return out
}

// A counter the effect adds to that holds no integer (a hand edit) fails
// the event whole, before any write that a retry would repeat: the day's
// transfers (its sent_cents was added first, and is taken back) and the
// stats (checked before the call's first event).
func TestEffectOnACounterThatIsNoIntegerLeavesNoHalfEffect(t *testing.T) {
	ctx := context.Background()
	now := time.Now().UTC()
	day, _ := Day(now)
	for _, tc := range []struct {
		name  string
		key   func(Keys) string
		field string
	}{
		{"day transfers", func(k Keys) string { return k.DayAccount(day, "ana") }, "transfers"},
		{"stats", Keys.Stats, "verdicts"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rdb := outboxtest.NewRedis(t)
			cfg := Config{Config: consumer.Config{Stream: rdb.Prefix + "outbox.event.transfer", KeyPrefix: rdb.Prefix + "fraud:"}}.withDefaults()
			e := &effects{cfg: cfg, rdb: rdb.Client, log: cfg.Logger}
			keys := Keys{Prefix: cfg.KeyPrefix}
			publish(t, rdb, cfg.Stream, "ana", 100, now)
			batches := entryBatches(t, rdb, cfg, 1)
			broken := tc.key(keys)
			if err := rdb.HSet(ctx, broken, tc.field, "x", "sent_cents", "5").Err(); err != nil {
				t.Fatal(err)
			}
			if res := e.Handle(ctx, batches[0]); res[0].Err == nil || !strings.Contains(res[0].Err.Error(), "integer") {
				t.Fatalf("TED with %s %s not an integer: %+v, want it refused", broken, tc.field, res[0])
			}
			if n, _ := rdb.ZCard(ctx, keys.Window("ana")).Result(); n != 0 {
				t.Errorf("ana's window holds %d transfers after the refused TED", n)
			}
			if v, _ := rdb.HGet(ctx, broken, "sent_cents").Result(); v != "5" {
				t.Errorf("%s sent_cents %q after the refused TED, want 5 (untouched)", broken, v)
			}
			if err := rdb.Del(ctx, broken).Err(); err != nil {
				t.Fatal(err)
			}
			if res := e.Handle(ctx, batches[0]); res[0].Err != nil || res[0].Outcome != "approve" {
				t.Fatalf("TED once fixed: %+v, want approve", res[0])
			}
			rep, err := ReadReport(ctx, rdb.Client, keys)
			if err != nil {
				t.Fatal(err)
			}
			if rep.Verdicts != 1 || rep.Accounts["ana"].Transfers != 1 || rep.Accounts["ana"].SentCents != 100 {
				t.Errorf("report %+v, want 1 verdict and ana's 1 transfer of 100", rep)
			}
		})
	}
}
