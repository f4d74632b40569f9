package fraud

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/outboxtest"
)

func TestMain(m *testing.M) { outboxtest.Main(m) }

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
	c, err := New(rdb.Client, Config{
		Stream: stream, KeyPrefix: rdb.Prefix + "fraud:", Consumer: "c1",
		AmountLimitCents: 50_000, WindowLimitCents: 100_000, Window: time.Hour,
	})
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
	if _, err := c.ReadNew(ctx); err != nil {
		t.Fatal(err)
	}
	for i, cs := range cases {
		got, err := Verdict(ctx, rdb.Client, rdb.Prefix+"fraud:", ids[i].String())
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
	rep, err := ReadReport(ctx, rdb.Client, rdb.Prefix+"fraud:")
	if err != nil {
		t.Fatal(err)
	}
	if rep.Verdicts != 6 || rep.Reviews != 2 || rep.Accounts["ana"] != (AccountTotals{SentCents: 150_000, Transfers: 4}) {
		t.Fatalf("report %+v", rep)
	}
}
