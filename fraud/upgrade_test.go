package fraud

import (
	"context"
	_ "embed"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/internal/outboxtest"
)

// The effect script of an earlier version (testdata, named by its date), when a sender's window held
// arrival numbers with their entries in a hash (testdata).
//
//go:embed testdata/effect-2026-12-03.lua
var effectSrc20261203 string

// A rolling upgrade runs consumers of both versions for a while. One of
// the previous version that meets a window of the new format fails the
// event before any write (it finds no entry for the member), so the event
// stays pending until a consumer of the new version applies it; it does not
// take the window for an older format and convert it into nonsense. The
// new version converts what the previous one wrote.
func TestPreviousVersionRefusesAWindowOfTheNewFormat(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	cfg := Config{Config: consumer.Config{Stream: rdb.Prefix + "s", KeyPrefix: rdb.Prefix + "fraud:", Consumer: "c", Logger: quiet}, WindowLimitCents: 100_000}.withDefaults()
	e := &effects{cfg: cfg, rdb: rdb.Client, log: quiet}
	keys := Keys{Prefix: cfg.KeyPrefix}
	previous := redis.NewScript(effectSrc20261203)
	at := time.Now().UTC().Add(-time.Minute)
	ted := func(cents int64) Event {
		at = at.Add(time.Second)
		return Event{EventID: uuid.New(), TransferID: uuid.New(), FromAccount: "ana", ToAccount: "bia",
			AmountCents: cents, Currency: "BRL", SettledAt: at}
	}
	run := func(s *redis.Script, ev Event) (Outcome, error) {
		if s != previous {
			call := e.newEffectCall(keys, uuid.NewString(), "", time.Now())
			call.add(keys, ev, 0, cfg.Retention, time.Now())
			out, err := effectResults(s.Eval(ctx, rdb.Client, call.keys, call.args...), 1)
			if err != nil {
				return 0, err
			}
			return out[0].outcome, out[0].err
		}
		res, err := s.Eval(ctx, rdb.Client, previousKeys(keys, ev, cfg), previousArgs(keys, ev, cfg)...).Int64Slice()
		if err != nil {
			return 0, err
		}
		return Outcome(res[0]), nil
	}
	verdicts := func() int64 { return mustInt(t, rdb.HGet(ctx, keys.Stats(), "verdicts")) }

	// The previous version writes, the new one converts and counts it.
	if out, err := run(previous, ted(40_000)); err != nil || out != OutcomeApprove {
		t.Fatalf("previous version, first TED: %v %v", out, err)
	}
	if out, err := run(effectScript, ted(40_000)); err != nil || out != OutcomeApprove {
		t.Fatalf("new version after it: %v %v", out, err)
	}
	// The previous version meets the new format: refused, nothing written.
	third := ted(30_000) // 110,000 in the window: review
	before, _ := rdb.ZRange(ctx, keys.Window("ana"), 0, -1).Result()
	if _, err := run(previous, third); err == nil || !strings.Contains(err.Error(), "missing") {
		t.Fatalf("previous version on a window of the new format: err %v, want it refused (an entry missing)", err)
	}
	after, _ := rdb.ZRange(ctx, keys.Window("ana"), 0, -1).Result()
	if strings.Join(after, " ") != strings.Join(before, " ") || verdicts() != 2 {
		t.Fatalf("the refused attempt wrote: window %v, was %v; %d verdicts, want 2", after, before, verdicts())
	}
	if out, err := run(effectScript, third); err != nil || out != OutcomeReview {
		t.Fatalf("new version, the refused TED: %v %v, want review (110,000 in the window)", out, err)
	}
	if verdicts() != 3 {
		t.Errorf("%d verdicts, want 3", verdicts())
	}
}

func mustInt(t *testing.T, cmd *redis.StringCmd) int64 {
	t.Helper()
	n, err := cmd.Int64()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// previousKeys and previousArgs are the previous version's call: one event's
// keys and arguments.
func previousKeys(k Keys, ev Event, cfg Config) []string {
	day, _ := Day(ev.SettledAt)
	return []string{
		k.Seen(ev.EventID.String()), k.Verdict(ev.TransferID.String()),
		k.DayAccount(day, ev.FromAccount), k.DayAccounts(day), k.Days(),
		k.Window(ev.FromAccount), k.Stats(), k.Alerts(), k.Lease(cfg.Group), k.Approved(ev.FromAccount),
		k.Audit(), k.BatchGate(uuid.NewString()), k.WindowEntries(ev.FromAccount),
	}
}

func previousArgs(k Keys, ev Event, cfg Config) []any {
	now := time.Now()
	day, dayNo := Day(ev.SettledAt)
	_, oldest := Day(now.Add(-cfg.Retention))
	ms := func(v int64) string { return strconv.FormatInt(v, 10) }
	return []any{
		int64(cfg.DedupeTTL / time.Second), ev.EventID.String(), ev.TransferID.String(), ev.FromAccount,
		ms(ev.AmountCents), ms(ev.SettledAt.UnixMilli()), ms(cfg.Window.Milliseconds()),
		ms(cfg.AmountLimitCents), ms(cfg.WindowLimitCents), ev.ToAccount, ev.Currency,
		ms(DayExpiry(ev.SettledAt, cfg.Retention).UnixMilli()), day, ms(dayNo), ms(oldest - 1),
		ms((cfg.DedupeTTL + 2*cfg.Window).Milliseconds()), ms(now.Add(-cfg.Retention).UnixMilli()),
		k.Verdict(""), "", cfg.AuditLen, "0",
	}
}
