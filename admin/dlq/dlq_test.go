package dlq_test

import (
	"context"
	"encoding/json"
	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/internal/consumertest"
	"io"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/admin/dlq"
	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/transfer"
)

// dlqFixture is one test's stream, consumer key prefix and dead-letter stream.
type dlqFixture struct {
	rdb                    outboxtest.Redis
	stream, keyPrefix, dlq string
	ctx                    context.Context
	t                      *testing.T
}

func newDLQFixture(t *testing.T) *dlqFixture {
	rdb := outboxtest.NewRedis(t)
	return &dlqFixture{
		rdb: rdb, stream: rdb.Prefix + "outbox.event.transfer", keyPrefix: rdb.Prefix + "fraud:",
		dlq: rdb.Prefix + "fraud:dlq", ctx: context.Background(), t: t,
	}
}

// consumer gives up on an undecodable entry at its first delivery.
func (f *dlqFixture) consumer(name string) *fraud.Consumer {
	f.t.Helper()
	c, err := fraud.New(f.rdb.Client, fraud.Config{Config: consumer.Config{Stream: f.stream, KeyPrefix: f.keyPrefix, Consumer: name, MaxDeliveries: 1, Block: 50 * time.Millisecond, ClaimInterval: 50 * time.Millisecond, ClaimMinIdle: 200 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}})
	if err != nil {
		f.t.Fatal(err)
	}
	if err := c.EnsureGroup(f.ctx); err != nil {
		f.t.Fatal(err)
	}
	return c
}

func (f *dlqFixture) report() fraud.Report {
	f.t.Helper()
	rep, err := fraud.ReadReport(f.ctx, f.rdb.Client, fraud.Keys{Prefix: f.keyPrefix})
	if err != nil {
		f.t.Fatal(err)
	}
	return rep
}

func (f *dlqFixture) xlen(key string) int64 {
	f.t.Helper()
	n, err := f.rdb.XLen(f.ctx, key).Result()
	if err != nil {
		f.t.Fatal(err)
	}
	return n
}

func (f *dlqFixture) xadd(stream string, values map[string]any) string {
	f.t.Helper()
	id, err := f.rdb.XAdd(f.ctx, &redis.XAddArgs{Stream: stream, Values: values}).Result()
	if err != nil {
		f.t.Fatal(err)
	}
	return id
}

// settledEntry returns the fields of a valid transfer.settled stream entry,
// as the relay writes them.
func settledEntry(t *testing.T, tr transfer.Transfer) map[string]any {
	t.Helper()
	eventID := uuid.New()
	payload, err := json.Marshal(transfer.SettledEvent{
		SchemaVersion: transfer.SchemaVersion, EventID: eventID, TransferID: tr.ID,
		FromAccount: tr.FromAccount, ToAccount: tr.ToAccount, AmountCents: tr.AmountCents, Currency: "BRL",
		SettledAt: time.Now().UTC(),
	})
	if err != nil {
		t.Fatal(err)
	}
	return map[string]any{
		"event_id": eventID.String(), "event_type": transfer.EventSettled, "aggregate_type": "transfer",
		"aggregate_id": tr.ID.String(), "payload": string(payload), "headers": `{"schema_version":"1"}`,
		"occurred_at": time.Now().UTC().Format(time.RFC3339Nano), "seq": "42",
	}
}

func strs(m map[string]any) map[string]string {
	out := map[string]string{}
	for k, v := range m {
		out[k], _ = v.(string)
	}
	return out
}

// An entry the consumer dead-lettered (through its real dead-letter path) is
// listed with its dlq_* fields, and a retry puts exactly its original fields
// back on the stream it came from and empties the dead-letter stream. Being
// poison, it is dead-lettered again, and applies no effect.
func TestDeadLetterRetryPutsTheOriginalEntryBackOnItsStream(t *testing.T) {
	f := newDLQFixture(t)
	c := f.consumer("c1")
	poison := map[string]any{"event_id": uuid.NewString(), "event_type": transfer.EventSettled, "aggregate_id": "t-1", "payload": "not json"}
	srcID := f.xadd(f.stream, poison)
	if _, err := consumertest.ReadNew(f.ctx, c.Consumer); err != nil {
		t.Fatal(err)
	}
	if rep := f.report(); rep.DeadLettered != 1 {
		t.Fatalf("report %+v: want the poison entry dead-lettered", rep)
	}

	letters, total, err := dlq.List(f.ctx, f.rdb.Client, f.keyPrefix, 10)
	if err != nil || total != 1 || len(letters) != 1 {
		t.Fatalf("List = %v, %d, %v; want one", letters, total, err)
	}
	d := letters[0]
	if d.EventID != poison["event_id"] || d.EventType != transfer.EventSettled || d.AggregateID != "t-1" ||
		d.Stream != f.stream || d.Group != fraud.DefaultGroup || d.EntryID != srcID || d.Deliveries != 1 ||
		d.Consumer != "c1" || !strings.Contains(d.Reason, "invalid event") {
		t.Fatalf("dead letter %+v", d)
	}
	if !maps.Equal(d.Fields, strs(poison)) {
		t.Fatalf("dead letter's original fields %v, want %v", d.Fields, poison)
	}

	// The fallback stream is for dead letters without dlq_stream: unused here.
	res, err := dlq.RetryAll(f.ctx, f.rdb.Client, f.keyPrefix, f.rdb.Prefix+"elsewhere")
	if err != nil || len(res.Retried) != 1 || len(res.Missing)+len(res.Failed) != 0 {
		t.Fatalf("RetryAll = %+v, %v; want one retried", res, err)
	}
	if r := res.Retried[0]; r.ID != d.ID || r.Stream != f.stream {
		t.Fatalf("retried %+v: want %s re-added to %s", r, d.ID, f.stream)
	}
	if n := f.xlen(f.dlq); n != 0 {
		t.Fatalf("dead-letter stream holds %d entries after the retry, want 0", n)
	}
	if n := f.xlen(f.rdb.Prefix + "elsewhere"); n != 0 {
		t.Fatalf("the fallback stream got %d entries", n)
	}
	msgs, err := f.rdb.XRange(f.ctx, f.stream, "-", "+").Result()
	if err != nil || len(msgs) != 2 {
		t.Fatalf("source stream holds %d entries (err %v), want the original and the replay", len(msgs), err)
	}
	if replay := msgs[1]; replay.ID != res.Retried[0].NewID || !maps.Equal(strs(replay.Values), strs(poison)) {
		t.Fatalf("replayed entry %s %v, want %s with exactly the original fields %v", replay.ID, replay.Values, res.Retried[0].NewID, poison)
	}

	if _, err := consumertest.ReadNew(f.ctx, c.Consumer); err != nil {
		t.Fatal(err)
	}
	if rep := f.report(); rep.DeadLettered != 2 || rep.Verdicts != 0 {
		t.Fatalf("report %+v: want the replayed poison dead-lettered again and no verdict", rep)
	}
}

// Dead letters of a valid event (two copies: say the relay published it twice
// and a consumer that could not yet decode it gave up on both) are replayed
// and a running consumer applies the event exactly once.
func TestRetriedDeadLettersAreAppliedExactlyOnce(t *testing.T) {
	f := newDLQFixture(t)
	c := f.consumer("c1")
	ctx, cancel := context.WithCancel(f.ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()

	tr := transfer.Transfer{ID: uuid.New(), FromAccount: "acct-1", ToAccount: "acct-2", AmountCents: 12_345}
	entry := settledEntry(t, tr)
	// The fields fraud/deadletter.lua appends to the original ones.
	letter := maps.Clone(entry)
	maps.Copy(letter, map[string]any{
		"dlq_stream": f.stream, "dlq_group": fraud.DefaultGroup, "dlq_entry_id": "1700000000000-0",
		"dlq_reason": "invalid event: payload: schema_version must be 0", "dlq_deliveries": "5", "dlq_consumer": "old-consumer",
	})
	a, b := f.xadd(f.dlq, letter), f.xadd(f.dlq, letter)

	res, err := dlq.Retry(f.ctx, f.rdb.Client, f.keyPrefix, []string{a, b, a}, fraud.DefaultStream)
	if err != nil || len(res.Retried) != 2 || len(res.Missing)+len(res.Failed) != 0 {
		t.Fatalf("Retry = %+v, %v; want both retried once", res, err)
	}
	if n := f.xlen(f.dlq); n != 0 {
		t.Fatalf("dead-letter stream holds %d entries after the retry, want 0", n)
	}
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		rep := f.report()
		return rep.Verdicts+rep.DuplicatesSkipped == 2
	}, "the replayed entries were not consumed")
	rep := f.report()
	if rep.Verdicts != 1 || rep.DuplicatesSkipped != 1 || rep.Accounts["acct-1"] != (fraud.AccountTotals{SentCents: 12_345, Transfers: 1}) {
		t.Fatalf("report %+v: want the event applied once and its copy skipped", rep)
	}
	if v, err := fraud.Verdict(f.ctx, f.rdb.Client, fraud.Keys{Prefix: f.keyPrefix}, tr.ID.String()); err != nil || v != "approve" {
		t.Fatalf("verdict %q, %v; want approve", v, err)
	}
	for _, m := range mustRange(t, f, f.stream) {
		if !maps.Equal(strs(m.Values), strs(entry)) {
			t.Fatalf("replayed entry %v, want exactly the original fields %v", m.Values, entry)
		}
	}

	// Retrying them again finds nothing: already retried.
	res, err = dlq.Retry(f.ctx, f.rdb.Client, f.keyPrefix, []string{a}, fraud.DefaultStream)
	if err != nil || len(res.Retried) != 0 || !slices.Equal(res.Missing, []string{a}) {
		t.Fatalf("second retry = %+v, %v; want %s missing", res, err, a)
	}
	if n := f.xlen(f.stream); n != 2 {
		t.Fatalf("stream holds %d entries, want 2", n)
	}
}

func mustRange(t *testing.T, f *dlqFixture, key string) []redis.XMessage {
	t.Helper()
	msgs, err := f.rdb.XRange(f.ctx, key, "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	return msgs
}

// A dead letter without dlq_stream goes to the fallback stream; one without
// original fields cannot be retried and stays; unknown ids are reported.
func TestDeadLetterRetryEdgeCases(t *testing.T) {
	f := newDLQFixture(t)
	if res, err := dlq.RetryAll(f.ctx, f.rdb.Client, f.keyPrefix, f.stream); err != nil ||
		len(res.Retried)+len(res.Missing)+len(res.Failed) != 0 {
		t.Fatalf("retry of an empty dead-letter stream: %+v, %v", res, err)
	}
	noSource := f.xadd(f.dlq, map[string]any{"event_id": "e-1", "payload": "{}", "dlq_reason": "old format"})
	trimmed := f.xadd(f.dlq, map[string]any{"dlq_stream": f.stream, "dlq_reason": "trimmed", "dlq_entry_id": "1-1"})
	fallback := f.rdb.Prefix + "fallback"

	res, err := dlq.RetryAll(f.ctx, f.rdb.Client, f.keyPrefix, fallback)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Retried) != 1 || res.Retried[0].ID != noSource || res.Retried[0].Stream != fallback {
		t.Fatalf("retried %+v: want %s re-added to the fallback stream", res.Retried, noSource)
	}
	if len(res.Failed) != 1 || res.Failed[0].ID != trimmed || !strings.Contains(res.Failed[0].Err.Error(), "no original fields") {
		t.Fatalf("failed %+v: want %s refused for having no original fields", res.Failed, trimmed)
	}
	if msgs := mustRange(t, f, fallback); len(msgs) != 1 || !maps.Equal(strs(msgs[0].Values), map[string]string{"event_id": "e-1", "payload": "{}"}) {
		t.Fatalf("fallback stream %v", msgs)
	}
	if msgs := mustRange(t, f, f.dlq); len(msgs) != 1 || msgs[0].ID != trimmed {
		t.Fatalf("dead-letter stream %v: want only the one that could not be retried", msgs)
	}
	if n := f.xlen(f.stream); n != 0 {
		t.Fatalf("source stream got %d entries from a dead letter without fields", n)
	}

	res, err = dlq.Retry(f.ctx, f.rdb.Client, f.keyPrefix, []string{"1-0", noSource}, fallback)
	if err != nil || len(res.Retried) != 0 || !slices.Equal(res.Missing, []string{"1-0", noSource}) {
		t.Fatalf("retry of unknown ids = %+v, %v; want both missing", res, err)
	}
	if _, err := dlq.Retry(f.ctx, f.rdb.Client, f.keyPrefix, []string{"1700000000000"}, fallback); err == nil {
		t.Fatal("an incomplete entry id: want an error")
	}

	// A dead letter from NATS JetStream stays: no Redis stream would
	// deliver it.
	fromNATS := f.xadd(f.dlq, map[string]any{"event_id": "e-2", "payload": "{}", "dlq_stream": f.stream, "dlq_broker": "nats"})
	res, err = dlq.Retry(f.ctx, f.rdb.Client, f.keyPrefix, []string{fromNATS}, fallback)
	if err != nil || len(res.Failed) != 1 || !strings.Contains(res.Failed[0].Err.Error(), "NATS") {
		t.Fatalf("retry of a NATS dead letter = %+v, %v; want it refused, saying why", res, err)
	}
	if n := f.xlen(f.stream); n != 0 {
		t.Fatalf("a NATS dead letter was re-added to the Redis stream (%d entries)", n)
	}
}

// --all pages through a long dead-letter stream, visiting each entry once:
// one that cannot be retried, at a page boundary, is reported once and stays.
func TestRetryAllDeadLettersPagesThroughEveryEntryOnce(t *testing.T) {
	f := newDLQFixture(t)
	var stuck string
	for i := range 250 {
		if i == 99 { // the last entry of the first page
			stuck = f.xadd(f.dlq, map[string]any{"dlq_stream": f.stream, "dlq_reason": "trimmed"})
			continue
		}
		f.xadd(f.dlq, map[string]any{"event_id": uuid.NewString(), "payload": "{}", "dlq_stream": f.stream})
	}
	res, err := dlq.RetryAll(f.ctx, f.rdb.Client, f.keyPrefix, f.stream)
	if err != nil || len(res.Retried) != 249 || len(res.Missing) != 0 || len(res.Failed) != 1 || res.Failed[0].ID != stuck {
		t.Fatalf("RetryAll: %d retried, missing %v, failed %v, err %v; want 249 retried and %s failed once",
			len(res.Retried), res.Missing, res.Failed, err, stuck)
	}
	if n, m := f.xlen(f.stream), f.xlen(f.dlq); n != 249 || m != 1 {
		t.Fatalf("stream holds %d entries and the dead-letter stream %d, want 249 and 1", n, m)
	}
}
