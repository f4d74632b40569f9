package relay_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/tedbank/outbox/internal/natsjs"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/relay/broker"
	"github.com/tedbank/outbox/relay/entry"
	"github.com/tedbank/outbox/relay/natsbroker"
	"github.com/tedbank/outbox/relay/redisbroker"
)

// ceWant is what each CloudEvents attribute of an event must be, from the
// entry's own fields.
func ceWant(field func(string) string, source string) map[string]string {
	return map[string]string{
		entry.CEID: field(entry.EventID), entry.CEType: field(entry.EventType), entry.CESource: source,
		entry.CESpecVersion: "1.0", entry.CEPartitionKey: field(entry.PartitionKey), entry.ContentType: "application/json",
	}
}

// With CloudEvents on, every entry also carries the event's CloudEvents
// attributes in binary mode (its own fields unchanged); off, the default,
// none.
func TestCloudEventsAttributesOnEveryEntry(t *testing.T) {
	f := newFixture(t)
	f.Settle(3)
	b := f.RedisBroker(nil, redisbroker.Config{CloudEvents: broker.CloudEvents{Enabled: true}})
	if n := f.DrainAll(f.NewRelayOn(f.RelayConfig("r1"), b)); n != 3 {
		t.Fatalf("published %d, want 3", n)
	}
	msgs, err := f.Redis.XRange(f.Ctx, f.Stream(), "-", "+").Result()
	if err != nil || len(msgs) != 3 {
		t.Fatalf("stream: %d entries (%v), want 3", len(msgs), err)
	}
	for _, m := range msgs {
		field := func(k string) string { s, _ := m.Values[k].(string); return s }
		for k, want := range ceWant(field, "/outbox/transfer") {
			if got := field(k); got != want || want == "" {
				t.Errorf("entry %s: %s = %q, want %q", m.ID, k, got, want)
			}
		}
		at, err := time.Parse(time.RFC3339Nano, field(entry.CETime))
		if occurred, _ := time.Parse(time.RFC3339Nano, field(entry.OccurredAt)); err != nil || !at.Equal(occurred) {
			t.Errorf("entry %s: ce_time %q (%v), want occurred_at %q", m.ID, field(entry.CETime), err, field(entry.OccurredAt))
		}
	}

	// Off, the default: the entry's own fields only (the same relay name:
	// with partition leases it takes its slots back).
	f.Settle(1)
	if n := f.DrainAll(f.NewRelay(f.RelayConfig("r1"), nil)); n != 1 {
		t.Fatalf("published %d, want 1", n)
	}
	last, err := f.Redis.XRevRangeN(f.Ctx, f.Stream(), "+", "-", 1).Result()
	if err != nil || len(last) != 1 {
		t.Fatal(last, err)
	}
	for _, k := range []string{entry.CEID, entry.CEType, entry.CESource, entry.CETime, entry.CESpecVersion, entry.CEPartitionKey, entry.ContentType} {
		if v, ok := last[0].Values[k]; ok {
			t.Errorf("CloudEvents off: the entry has %s = %v", k, v)
		}
	}
}

// On JetStream the attributes are headers, under the NATS binding's names
// (ce-id, ...) and the entries' (ce_id, ...), with the source given.
func TestCloudEventsHeadersOnJetStream(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.Settle(2)
	nc, js, err := natsjs.Connect(outboxtest.NATSURL(t), "outbox-test")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	stream := outboxtest.NATSStream(t)
	cfg := f.RelayConfig("r1")
	r, err := natsbroker.NewRelay(f.Pool, natsbroker.Config{JS: js, Stream: stream,
		CloudEvents: broker.CloudEvents{Enabled: true, Source: "urn:tedbank:spi"}}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if n := f.DrainAll(r); n != 2 {
		t.Fatalf("published %d, want 2", n)
	}
	s, err := js.Stream(context.Background(), stream)
	if err != nil {
		t.Fatal(err)
	}
	for seq := uint64(1); seq <= 2; seq++ {
		m, err := s.GetMsg(context.Background(), seq)
		if err != nil {
			t.Fatal(err)
		}
		for k, want := range ceWant(m.Header.Get, "urn:tedbank:spi") {
			if got := m.Header.Get(k); got != want || want == "" {
				t.Errorf("message %d: header %s = %q, want %q", seq, k, got, want)
			}
			if name, ok := strings.CutPrefix(k, entry.CEFieldPrefix); ok {
				if got := m.Header.Get(entry.CEHeaderPrefix + name); got != want {
					t.Errorf("message %d: header %s%s = %q, want %q", seq, entry.CEHeaderPrefix, name, got, want)
				}
			}
		}
	}
}
