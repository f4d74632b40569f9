package fraud

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/relay/entry"
	"github.com/tedbank/outbox/transfer/settled"
)

// How the consumer handles what at-least-once delivery brings: a consumer
// that died holding entries, the same event delivered several times, entries
// it can never process, and a failure that is not the entry's fault.

// deliveries is one test's stream and key prefix, with the events published
// to it.
type deliveries struct {
	t      *testing.T
	ctx    context.Context
	rdb    outboxtest.Redis
	stream string
	prefix string
	events []settled.Payload
}

func newDeliveries(t *testing.T) *deliveries {
	rdb := outboxtest.NewRedis(t)
	return &deliveries{t: t, ctx: t.Context(), rdb: rdb, stream: rdb.Prefix + "outbox.event.transfer", prefix: rdb.Prefix + "fraud:"}
}

// publish adds n events, each of a sender of its own, as the relay writes
// them (relay/entry), and returns their entries' values.
func (d *deliveries) publish(n int) [][]any {
	d.t.Helper()
	var all [][]any
	for range n {
		values := d.event()
		d.xadd(values)
		all = append(all, values)
	}
	return all
}

// event makes the next event, of a sender of its own, and returns its
// entry's values.
func (d *deliveries) event() []any {
	i := len(d.events)
	ev := settled.Payload{SchemaVersion: settled.Version, EventID: uuid.New(), TransferID: uuid.New(),
		FromAccount: fmt.Sprintf("acct-%03d", i), ToAccount: "dest", AmountCents: int64(100 + i), Currency: "BRL",
		SettledAt: time.Now().UTC()}
	p, _ := json.Marshal(ev)
	d.events = append(d.events, ev)
	return []any{entry.EventID, ev.EventID.String(), entry.EventType, settled.Type, entry.AggregateType, settled.AggregateType,
		entry.AggregateID, ev.TransferID.String(), entry.Payload, string(p), entry.Headers, "{}"}
}

func (d *deliveries) xadd(values []any) {
	d.t.Helper()
	if err := d.rdb.XAdd(d.ctx, &redis.XAddArgs{Stream: d.stream, Values: values}).Err(); err != nil {
		d.t.Fatal(err)
	}
}

// run runs a consumer until the test ends.
func (d *deliveries) run(name string, mutate func(*Config)) {
	d.t.Helper()
	cfg := Config{Config: consumer.Config{Stream: d.stream, KeyPrefix: d.prefix, Consumer: name, Block: 100 * time.Millisecond, ClaimInterval: 100 * time.Millisecond, ClaimMinIdle: 500 * time.Millisecond}}
	if mutate != nil {
		mutate(&cfg)
	}
	c := newGroupConsumer(d.t, d.rdb, cfg)
	ctx, cancel := context.WithCancel(d.ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	d.t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			d.t.Errorf("consumer %s: %v", name, err)
		}
	})
}

func (d *deliveries) report() Report {
	d.t.Helper()
	rep, err := ReadReport(d.ctx, d.rdb.Client, Keys{Prefix: d.prefix})
	if err != nil {
		d.t.Fatal(err)
	}
	return rep
}

func (d *deliveries) pending() []redis.XPendingExt {
	d.t.Helper()
	pend, err := d.rdb.XPendingExt(d.ctx, &redis.XPendingExtArgs{Stream: d.stream, Group: DefaultGroup, Start: "-", End: "+", Count: 100}).Result()
	if redis.HasErrorPrefix(err, "NOGROUP") {
		return nil // no consumer has created the group yet
	}
	if err != nil {
		d.t.Fatal(err)
	}
	return pend
}

// checkEffectsOnce asserts one verdict per published event and each sender's
// totals equal to its one transfer.
func (d *deliveries) checkEffectsOnce() {
	d.t.Helper()
	rep := d.report()
	if rep.Verdicts != int64(len(d.events)) {
		d.t.Errorf("verdicts = %d, want %d (one per event)", rep.Verdicts, len(d.events))
	}
	for _, ev := range d.events {
		if got, want := rep.Accounts[ev.FromAccount], (AccountTotals{SentCents: ev.AmountCents, Transfers: 1}); got != want {
			d.t.Errorf("account %s totals = %+v, want %+v", ev.FromAccount, got, want)
		}
		if v, err := Verdict(d.ctx, d.rdb.Client, Keys{Prefix: d.prefix}, ev.TransferID.String()); err != nil || v == "" {
			d.t.Errorf("transfer %s has no verdict (err %v)", ev.TransferID, err)
		}
	}
}

// A consumer process SIGKILLed right after reading (the real outbox binary,
// its fail point fraud.after-read) leaves its entries pending; another
// consumer takes its partition once the lease runs out, claims them and
// applies each once.
func TestDeadConsumersEntriesAreClaimed(t *testing.T) {
	d := newDeliveries(t)
	d.publish(10)
	cmd := exec.Command(outboxtest.Binary(t), "fraud", "--stream", d.stream, "--key-prefix", d.prefix, "--consumer", "dead",
		"--block", "100ms", "--partition-lease", "1s")
	cmd.Env = append(os.Environ(), "REDIS_URL="+d.rdb.URL, "OUTBOX_FAILPOINT=fraud.after-read")
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("want death by SIGKILL at the fail point, got %v\n%s", err, out)
	}
	if rep := d.report(); rep.Verdicts != 0 {
		t.Fatalf("verdicts %d, want 0 (died before the effect)", rep.Verdicts)
	}
	if n := len(d.pending()); n != 10 {
		t.Fatalf("%d entries pending with the dead consumer, want 10", n)
	}
	d.run("alive", func(c *Config) { c.ClaimMinIdle = 300 * time.Millisecond })
	outboxtest.Eventually(t, 10*time.Second, func() bool { return d.report().Verdicts == 10 }, "dead consumer's entries not claimed")
	outboxtest.Eventually(t, 5*time.Second, func() bool { return len(d.pending()) == 0 }, "entries still pending: %v", d.pending())
	d.checkEffectsOnce()
}

// Every event delivered three times (three relays that each believed they
// owned it), read by two consumers: each effect is applied once, and the
// other deliveries are counted as duplicates.
func TestDuplicateDeliveryAppliesEffectOnce(t *testing.T) {
	d := newDeliveries(t)
	entries := d.publish(20)
	for range 2 {
		for _, v := range entries {
			d.xadd(v)
		}
	}
	d.run("c1", nil)
	d.run("c2", nil)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		rep := d.report()
		return rep.Verdicts+rep.DuplicatesSkipped == 60
	}, "not every delivery was handled")
	if rep := d.report(); rep.DuplicatesSkipped != 40 {
		t.Fatalf("duplicates skipped %d, want 40", rep.DuplicatesSkipped)
	}
	d.checkEffectsOnce()
}

// Entries that can never be processed stay pending until their last
// delivery, then move to the dead-letter stream with their reason; the valid
// ones around them are applied.
func TestPoisonEntriesAreDeadLettered(t *testing.T) {
	d := newDeliveries(t)
	for _, v := range [][]any{
		{entry.EventID, uuid.NewString(), entry.EventType, settled.Type, entry.Payload, "not json"},
		{entry.EventID, uuid.NewString(), entry.EventType, settled.Type, entry.Payload, `{"amount_cents":"ten"}`},
		{entry.EventID, uuid.NewString(), entry.EventType, "transfer.reversed", entry.Payload, `{}`},
		{entry.Payload, `{}`},
	} {
		d.xadd(v)
	}
	d.publish(3)
	d.run("c1", func(c *Config) { c.MaxDeliveries = 3; c.ClaimMinIdle = 50 * time.Millisecond })
	outboxtest.Eventually(t, 15*time.Second, func() bool { return d.report().DeadLettered == 4 }, "poison entries not dead-lettered")
	dlq, err := d.rdb.XRange(d.ctx, d.prefix+"dlq", "-", "+").Result()
	if err != nil || len(dlq) != 4 {
		t.Fatalf("dead-letter stream holds %d entries (err %v), want 4", len(dlq), err)
	}
	for _, m := range dlq {
		if n, _ := strconv.Atoi(m.Values["dlq_deliveries"].(string)); n < 3 || m.Values["dlq_reason"] == "" {
			t.Fatalf("dead letter %v: want deliveries >= 3 and a reason", m.Values)
		}
	}
	outboxtest.Eventually(t, 5*time.Second, func() bool { return len(d.pending()) == 0 }, "entries still pending: %v", d.pending())
	d.checkEffectsOnce()
}

// An effect that fails for a reason that is not the entry's (here a key in
// the way of the alerts stream, and every TED over the amount limit: every
// effect fails) is retried however often it is delivered, never
// dead-lettered nor half-applied, and applied once the fault clears.
func TestTransientEffectFailureIsRetriedNotDeadLettered(t *testing.T) {
	d := newDeliveries(t)
	d.publish(5)
	alerts := d.prefix + "alerts"
	if err := d.rdb.Set(d.ctx, alerts, "in the way", 0).Err(); err != nil {
		t.Fatal(err)
	}
	d.run("c1", func(c *Config) {
		c.MaxDeliveries, c.ClaimMinIdle, c.ClaimInterval = 2, 20*time.Millisecond, 20*time.Millisecond
		c.AmountLimitCents = 99
	})
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		pend := d.pending()
		return len(pend) == 5 && pend[0].RetryCount > 3
	}, "entries were not redelivered past MaxDeliveries")
	if rep := d.report(); rep.DeadLettered != 0 || rep.Verdicts != 0 {
		t.Fatalf("report %+v: a transient failure dead-lettered or half-applied entries", rep)
	}
	if err := d.rdb.Del(d.ctx, alerts).Err(); err != nil {
		t.Fatal(err)
	}
	outboxtest.Eventually(t, 15*time.Second, func() bool { return d.report().Verdicts == 5 }, "entries not applied after the fault cleared")
	d.checkEffectsOnce()
}

// A Redis of the test's own refuses writes (out of memory under noeviction)
// for 6 s while events keep arriving (each XADD let through alone: one
// pipeline lifts the limit, adds the entry and sets it again, which no other
// client's command can come between), then takes writes again right after
// one of the consumer's retries failed. The effects refused meanwhile are all
// applied within about a second: the retries are at most a second apart
// (consumer.MaxRetryDelay), and a read blocked for new entries does not put
// off the retry that is due. Before, the retry could come 5 s later, and a
// read blocked for new entries kept it waiting up to Block.
func TestEffectsAreBackWithinASecondOfRedisTakingWritesAgain(t *testing.T) {
	t.Parallel()
	d := &deliveries{t: t, ctx: t.Context(), rdb: outboxtest.OwnRedis(t, "--maxmemory-policy", "noeviction"),
		stream: "outbox.event.transfer", prefix: "fraud:"}
	retried := make(chan struct{}, 1)
	// The default claims (none of idle entries within the test), and reads
	// that block for 4 s (2 s by default).
	d.run("c1", func(c *Config) {
		c.Block, c.ClaimInterval, c.ClaimMinIdle = 4*time.Second, 0, 0
		c.Logger = slog.New(retryLogged{slog.Default().Handler(), retried})
	})
	d.publish(1)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return d.report().Verdicts == 1 }, "the first event was not applied")

	if err := d.rdb.ConfigSet(d.ctx, "maxmemory", "1").Err(); err != nil {
		t.Fatal(err)
	}
	refusedBefore := oomErrors(t, d)
	const outage = 6 * time.Second
	for end := time.Now().Add(outage); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		values := d.event()
		_, err := d.rdb.Pipelined(d.ctx, func(p redis.Pipeliner) error {
			p.ConfigSet(d.ctx, "maxmemory", "0")
			p.XAdd(d.ctx, &redis.XAddArgs{Stream: d.stream, Values: values})
			p.ConfigSet(d.ctx, "maxmemory", "1")
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	// Right after a retry failed: the next waits a whole step.
	select {
	case <-retried:
	default:
	}
	select {
	case <-retried:
	case <-time.After(15 * time.Second):
		t.Fatal("the consumer did not retry the refused effects within 15 s")
	}
	verdictsDuring := d.report().Verdicts
	refused := oomErrors(t, d) - refusedBefore
	if err := d.rdb.ConfigSet(d.ctx, "maxmemory", "0").Err(); err != nil {
		t.Fatal(err)
	}
	back := time.Now()
	outboxtest.Eventually(t, 15*time.Second, func() bool { return d.report().Verdicts == int64(len(d.events)) },
		"%d of %d events applied", d.report().Verdicts, len(d.events))
	took := time.Since(back)
	t.Logf("outage %s: Redis refused %d commands; the %d events were applied %s after it took writes again",
		outage, refused, len(d.events)-1, took.Round(time.Millisecond))
	if refused == 0 || verdictsDuring != 1 {
		t.Fatalf("Redis refused %d commands and %d events were applied during the outage: the outage did not bite",
			refused, verdictsDuring-1)
	}
	// A retry's step is at most a second; the rest is slack for a loaded
	// machine under -race.
	if took > 2*time.Second {
		t.Errorf("the events were applied %s after Redis took writes again, want within about a second", took.Round(time.Millisecond))
	}
	d.checkEffectsOnce()
}

// retryLogged passes records on, and signals each failed retry of a
// partition's pending entries.
type retryLogged struct {
	slog.Handler
	retried chan struct{}
}

func (h retryLogged) Handle(ctx context.Context, r slog.Record) error {
	if r.Message == "pending entries failed again; retrying" {
		select {
		case h.retried <- struct{}{}:
		default:
		}
	}
	return h.Handler.Handle(ctx, r)
}

func (h retryLogged) WithAttrs(as []slog.Attr) slog.Handler {
	return retryLogged{h.Handler.WithAttrs(as), h.retried}
}

func (h retryLogged) WithGroup(name string) slog.Handler {
	return retryLogged{h.Handler.WithGroup(name), h.retried}
}

// oomErrors is how many commands Redis refused as out of memory.
func oomErrors(t *testing.T, d *deliveries) int64 {
	t.Helper()
	info, err := d.rdb.Info(d.ctx, "errorstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "errorstat_OOM:count="); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	return 0
}
