package fraud

import (
	"context"
	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/internal/consumertest"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/outboxtest"
)

// Every key the consumer writes has a bounded life, so that Redis under
// noeviction never fills up: each key expires, or is a structure the
// consumer trims (the alerts stream, the days index) or of fixed size (the
// stats hash). A verdict expires with the totals of its day; an event
// settled longer ago than the retention leaves neither.
func TestEveryKeyTheConsumerWritesIsBounded(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	stream := rdb.Prefix + "outbox.event.transfer"
	prefix := rdb.Prefix + "fraud:"
	keys := Keys{Prefix: prefix}
	const retention = 48 * time.Hour
	c, err := New(rdb.Client, Config{Config: consumer.Config{Stream: stream, KeyPrefix: prefix, Consumer: "c1"}, AmountLimitCents: 50_000, Retention: retention, DedupeTTL: 2 * time.Hour, Window: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.EnsureGroup(ctx); err != nil {
		t.Fatal(err)
	}
	// Left by earlier days: an alert and a day in the index, both older than
	// the retention.
	if err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: keys.Alerts(), ID: "1-0", Values: []any{"reason", "old"}}).Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.ZAdd(ctx, keys.Days(), redis.Z{Score: 10957, Member: "2000-01-01"}).Err(); err != nil {
		t.Fatal(err)
	}

	now := time.Now().UTC()
	long := now.Add(-retention - 48*time.Hour)
	review := publish(t, rdb, stream, "ana", 60_000, now) // above the amount limit
	approve := publish(t, rdb, stream, "bia", 10_000, now)
	old := publish(t, rdb, stream, "caio", 10_000, long) // judged, but past the retention
	if n, err := consumertest.ReadNew(ctx, c.Consumer); err != nil || n != 3 {
		t.Fatalf("ReadNew: %d, %v", n, err)
	}

	for tid, want := range map[string]string{review.String(): "review", approve.String(): "approve", old.String(): ""} {
		if got, err := Verdict(ctx, rdb.Client, Keys{Prefix: prefix}, tid); err != nil || got != want {
			t.Errorf("verdict of %s: %q (%v), want %q", tid, got, err, want)
		}
	}
	day, _ := Day(now)
	wantExpiry := DayExpiry(now, retention).UnixMilli()
	for _, k := range []string{keys.Verdict(review.String()), keys.DayAccount(day, "ana"), keys.DayAccounts(day)} {
		if at, err := rdb.PExpireTime(ctx, k).Result(); err != nil || at.Milliseconds() != wantExpiry {
			t.Errorf("%s expires at %v (%v), want %d: a verdict and its day's totals go together", k, at, err, wantExpiry)
		}
	}
	oldDay, _ := Day(long)
	if n, err := rdb.Exists(ctx, keys.DayAccount(oldDay, "caio"), keys.DayAccounts(oldDay)).Result(); err != nil || n != 0 {
		t.Errorf("totals of a day past the retention were kept (%d keys, %v)", n, err)
	}

	var names []string
	iter := rdb.Scan(ctx, 0, prefix+"*", 100).Iterator()
	for iter.Next(ctx) {
		names = append(names, iter.Val())
	}
	if err := iter.Err(); err != nil {
		t.Fatal(err)
	}
	for _, k := range names {
		switch k {
		case keys.Stats():
			if n, _ := rdb.HLen(ctx, k).Result(); n > 4 {
				t.Errorf("%s has %d fields, want the fixed counters", k, n)
			}
			continue
		case keys.Alerts():
			alerts, _ := rdb.XRange(ctx, k, "-", "+").Result()
			if len(alerts) != 1 || alerts[0].Values["transfer_id"] != review.String() {
				t.Errorf("alerts %v: want the old one trimmed and the new one kept", alerts)
			}
			continue
		case keys.Days():
			days, _ := rdb.ZRange(ctx, k, 0, -1).Result()
			if strings.Join(days, ",") != day {
				t.Errorf("days index %v, want [%s]: the old day trimmed, the day past the retention never added", days, day)
			}
			continue
		}
		ttl, err := rdb.PTTL(ctx, k).Result()
		if err != nil || ttl <= 0 {
			t.Errorf("%s has no expiry (PTTL %v, %v)", k, ttl, err)
		}
	}
	if len(names) < 10 {
		t.Fatalf("only %d keys under %s: %v", len(names), prefix, names)
	}
	rep, err := ReadReport(ctx, rdb.Client, Keys{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Verdicts != 3 || len(rep.Accounts) != 2 || rep.Accounts["ana"].SentCents != 60_000 {
		t.Fatalf("report %+v: want 3 effects, totals for ana and bia only", rep)
	}
}
