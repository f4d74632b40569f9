// Package brokertest checks a broker.Broker against what the relay expects
// of it, on a real server: a team writing its own broker (Kafka, a cloud
// queue) runs the same checks as relay/redisbroker and relay/natsbroker.
//
//	func TestBroker(t *testing.T) {
//		brokertest.Run(t, func(t *testing.T) brokertest.Harness {
//			b := newMyBroker(t) // a broker of this test's own
//			return brokertest.Harness{
//				Broker: b,
//				Dest:   func(name string) string { return myPrefix(t) + name },
//				Read:   func(ctx context.Context, dest string) ([]brokertest.Entry, error) { ... },
//				Down:   proxy.Down, Up: proxy.Up, // or nil: the outage is not checked
//			}
//		})
//	}
//
// The checks: each message reaches its destination in the order given,
// with the fields of package relay/entry, under the id Publish returned;
// batches to several destinations, concurrent batches, an empty batch, a
// large payload and a message published again; a cancelled publish fails
// every message; the errors a relay classifies (Unavailable, MaybeSent) are
// classified; with the server unreachable every message fails as
// Unavailable, Ping fails, and publishing works again once it is back. A
// relay built on a broker that passes them keeps its guarantees; the relay's
// own tests and internal/conformance check the rest with a relay running.
package brokertest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/tedbank/outbox/relay/broker"
	"github.com/tedbank/outbox/relay/entry"
)

// Harness is one test's broker and what the checks need around it.
type Harness struct {
	// Broker is the broker under test.
	Broker broker.Broker
	// Dest returns a destination of this test's own (a stream, a
	// subject) for a short lowercase name: where the checks publish and
	// read. Different names are different destinations.
	Dest func(name string) string
	// Read returns every message at dest, oldest first, as a consumer
	// decodes it.
	Read func(ctx context.Context, dest string) ([]Entry, error)
	// Down makes the server unreachable (a proxy that refuses
	// connections, a server stopped) until Up. Both nil: the outage check
	// is skipped, and says so.
	Down, Up func()
}

// Entry is one message as a consumer reads it.
type Entry struct {
	// ID is the message's id at the broker: what Publish returned for it.
	ID string
	// Fields are the message's fields by package relay/entry's names,
	// entry.Payload the payload.
	Fields map[string]string
}

// Timeout bounds each publish and read of the checks (the relay's default
// publish timeout).
const Timeout = 5 * time.Second

// Run runs every check as a subtest, each with a harness of its own.
func Run(t *testing.T, newHarness func(t *testing.T) Harness) {
	t.Helper()
	for _, c := range []struct {
		name  string
		check func(t *testing.T, h Harness)
	}{
		{"PublishesInOrderWithTheEntryFields", publishesInOrder},
		{"EmptyBatch", emptyBatch},
		{"ConcurrentBatches", concurrentBatches},
		{"LargePayload", largePayload},
		{"PublishedAgain", publishedAgain},
		{"CancelledPublishFailsEveryMessage", cancelledPublish},
		{"ClassifiesErrors", classifiesErrors},
		{"OutageIsUnavailable", outage},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t)
			if h.Broker == nil || h.Dest == nil || h.Read == nil {
				t.Fatal("brokertest: the harness needs Broker, Dest and Read")
			}
			c.check(t, h)
		})
	}
}

// seq numbers the messages of a test binary, so that every message has a
// sequence of its own, increasing in the order messages are made.
var seq struct {
	sync.Mutex
	n int64
}

// message returns a message of aggregate "kit" for key, with payload.
func message(key, payload string) broker.Message {
	seq.Lock()
	seq.n++
	n := seq.n
	seq.Unlock()
	return broker.Message{
		ID: uuid.New(), Seq: n, AggregateType: "kit", AggregateID: "agg-" + key, EventType: "kit.happened",
		Payload: []byte(payload), Headers: []byte(`{"kit":"yes"}`),
		CreatedAt: time.Now().UTC().Truncate(time.Microsecond), PartitionKey: key,
	}
}

// publish publishes msgs to dests and fails t on any error.
func publish(t *testing.T, h Harness, msgs []broker.Message, dests []string) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	ids, errs := h.Broker.Publish(ctx, msgs, dests)
	if len(ids) != len(msgs) || len(errs) != len(msgs) {
		t.Fatalf("Publish of %d messages returned %d ids and %d errors: one of each per message", len(msgs), len(ids), len(errs))
	}
	for i, err := range errs {
		if err != nil {
			t.Fatalf("Publish: message %d of %d to %s: %v", i, len(msgs), dests[i], err)
		}
		if ids[i] == "" {
			t.Fatalf("Publish: message %d of %d to %s: no id and no error", i, len(msgs), dests[i])
		}
	}
	return ids
}

// read returns what dest holds.
func read(t *testing.T, h Harness, dest string) []Entry {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	got, err := h.Read(ctx, dest)
	if err != nil {
		t.Fatalf("Read %s: %v", dest, err)
	}
	return got
}

// expect checks that got holds msgs in order, under ids, with their fields.
func expect(t *testing.T, dest string, got []Entry, msgs []broker.Message, ids []string) {
	t.Helper()
	if len(got) != len(msgs) {
		t.Fatalf("%s holds %d messages, want %d", dest, len(got), len(msgs))
	}
	for i, m := range msgs {
		if err := sameMessage(got[i], m); err != nil {
			t.Fatalf("%s, message %d of %d: %v", dest, i, len(msgs), err)
		}
		if ids != nil && got[i].ID != ids[i] {
			t.Fatalf("%s, message %d (%s): id %q at the broker, Publish returned %q", dest, i, m.ID, got[i].ID, ids[i])
		}
	}
}

// sameMessage reports how e differs from the message m as published.
func sameMessage(e Entry, m broker.Message) error {
	for name, want := range map[string]string{
		entry.EventID: m.ID.String(), entry.EventType: m.EventType, entry.AggregateType: m.AggregateType,
		entry.AggregateID: m.AggregateID, entry.Payload: string(m.Payload), entry.Seq: strconv.FormatInt(m.Seq, 10),
		entry.PartitionKey: m.PartitionKey,
	} {
		if got, ok := e.Fields[name]; !ok || got != want {
			return fmt.Errorf("field %s %s, want %.80q", name, shown(got, ok), want)
		}
	}
	at, err := time.Parse(time.RFC3339Nano, e.Fields[entry.OccurredAt])
	if err != nil || !at.Equal(m.CreatedAt) {
		return fmt.Errorf("field %s %q, want %s in RFC 3339 (%v)", entry.OccurredAt, e.Fields[entry.OccurredAt],
			m.CreatedAt.Format(time.RFC3339Nano), err)
	}
	// The headers go on as a JSON object; a broker may add the trace
	// context of its span to them.
	var headers map[string]string
	if err := json.Unmarshal([]byte(e.Fields[entry.Headers]), &headers); err != nil || headers["kit"] != "yes" {
		return fmt.Errorf("field %s %q, want a JSON object of strings with the message's headers (%v)",
			entry.Headers, e.Fields[entry.Headers], err)
	}
	return nil
}

func shown(v string, ok bool) string {
	if !ok {
		return "missing"
	}
	return fmt.Sprintf("%.80q", v)
}

// Messages of one batch to two destinations, interleaved, each keep their
// order at their destination, with every field of relay/entry and the id
// Publish returned.
func publishesInOrder(t *testing.T, h Harness) {
	a, b := h.Dest("a"), h.Dest("b")
	if a == b {
		t.Fatalf("Dest(a) and Dest(b) are both %q", a)
	}
	var msgs []broker.Message
	var dests []string
	for i := range 7 {
		dest, key := a, "k1"
		if i%3 == 1 {
			dest, key = b, "k2"
		}
		msgs = append(msgs, message(key, fmt.Sprintf(`{"n":%d,"text":"ação \"quoted\"\n"}`, i)))
		dests = append(dests, dest)
	}
	ids := publish(t, h, msgs, dests)
	for _, dest := range []string{a, b} {
		var want []broker.Message
		var wantIDs []string
		for i := range msgs {
			if dests[i] == dest {
				want, wantIDs = append(want, msgs[i]), append(wantIDs, ids[i])
			}
		}
		expect(t, dest, read(t, h, dest), want, wantIDs)
	}
	// A second batch follows the first at its destination.
	more := []broker.Message{message("k1", `{"n":7}`), message("k1", `{"n":8}`)}
	publish(t, h, more, []string{a, a})
	var want []broker.Message
	for i := range msgs {
		if dests[i] == a {
			want = append(want, msgs[i])
		}
	}
	expect(t, a, read(t, h, a), append(want, more...), nil)
}

// An empty batch publishes nothing and fails nothing.
func emptyBatch(t *testing.T, h Harness) {
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	ids, errs := h.Broker.Publish(ctx, nil, nil)
	if len(ids) != 0 || len(errs) != 0 {
		t.Fatalf("Publish of no message: ids %v, errors %v", ids, errs)
	}
	if err := h.Broker.Ping(ctx); err != nil {
		t.Fatalf("Ping: %v", err)
	}
}

// Batches published at the same time (the relay publishes one batch at a
// time, but a process may run several relays on one broker) each keep
// their order.
func concurrentBatches(t *testing.T, h Harness) {
	const batches, size = 4, 25
	msgs := make([][]broker.Message, batches)
	errc := make(chan error, batches)
	for g := range batches {
		dest := h.Dest("c" + strconv.Itoa(g))
		dests := make([]string, size)
		for i := range size {
			msgs[g] = append(msgs[g], message("k"+strconv.Itoa(g), fmt.Sprintf(`{"g":%d,"i":%d}`, g, i)))
			dests[i] = dest
		}
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), Timeout)
			defer cancel()
			_, errs := h.Broker.Publish(ctx, msgs[g], dests)
			errc <- errors.Join(errs...)
		}()
	}
	for range batches {
		if err := <-errc; err != nil {
			t.Fatalf("concurrent Publish: %v", err)
		}
	}
	for g := range batches {
		dest := h.Dest("c" + strconv.Itoa(g))
		expect(t, dest, read(t, h, dest), msgs[g], nil)
	}
}

// A payload of 256 KiB arrives byte for byte (the relay's claims bound a
// batch by bytes, not one event: docs/design.md).
func largePayload(t *testing.T, h Harness) {
	dest := h.Dest("large")
	big := `{"blob":"` + strings.Repeat("x0123456789abcdef", 256<<10/17) + `"}`
	msgs := []broker.Message{message("k", `{"n":0}`), message("k", big), message("k", `{"n":2}`)}
	ids := publish(t, h, msgs, []string{dest, dest, dest})
	expect(t, dest, read(t, h, dest), msgs, ids)
}

// A message published again (its mark was lost, its relay died) is not an
// error: it arrives once or twice, and consumers deduplicate by event id.
func publishedAgain(t *testing.T, h Harness) {
	dest := h.Dest("again")
	m := message("k", `{"n":1}`)
	publish(t, h, []broker.Message{m}, []string{dest})
	publish(t, h, []broker.Message{m}, []string{dest})
	got := read(t, h, dest)
	if len(got) < 1 || len(got) > 2 {
		t.Fatalf("%s holds %d messages after one published twice, want 1 or 2", dest, len(got))
	}
	for _, e := range got {
		if err := sameMessage(e, m); err != nil {
			t.Fatal(err)
		}
	}
}

// A publish whose context is done fails each message, promptly: the relay
// bounds every publish with its publish timeout and counts what failed.
func cancelledPublish(t *testing.T, h Harness) {
	dest := h.Dest("cancelled")
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	msgs := []broker.Message{message("k", `{"n":1}`), message("k", `{"n":2}`)}
	start := time.Now()
	ids, errs := h.Broker.Publish(ctx, msgs, []string{dest, dest})
	if took := time.Since(start); took > Timeout {
		t.Fatalf("Publish with a cancelled context took %s", took)
	}
	if len(ids) != len(msgs) || len(errs) != len(msgs) {
		t.Fatalf("Publish of %d messages returned %d ids and %d errors", len(msgs), len(ids), len(errs))
	}
	for i, err := range errs {
		if err == nil {
			t.Fatalf("message %d published (id %q) with its context cancelled before Publish", i, ids[i])
		}
	}
}

// Errors the relay acts on are classified: a wrapped broker.ErrUnavailable
// is unavailable, a plain error of one message is not, and no error was
// not sent.
func classifiesErrors(t *testing.T, h Harness) {
	b := h.Broker
	if !b.Unavailable(fmt.Errorf("publish: %w", broker.ErrUnavailable)) {
		t.Error("Unavailable(an error wrapping broker.ErrUnavailable) = false")
	}
	if b.Unavailable(errors.New("message refused: payload is not what this destination takes")) {
		t.Error("Unavailable(a plain error) = true: a message's own failure would never count an attempt, nor go dead")
	}
	if b.Unavailable(nil) || b.MaybeSent(nil) {
		t.Errorf("Unavailable(nil) = %v, MaybeSent(nil) = %v, want false", b.Unavailable(nil), b.MaybeSent(nil))
	}
}

// With the server unreachable every message of a batch fails as
// Unavailable (the relay backs off and counts no attempt) and Ping fails;
// once it is back, Ping answers and a batch is published.
func outage(t *testing.T, h Harness) {
	if h.Down == nil || h.Up == nil {
		t.Skip("brokertest: the harness has no Down and Up: the outage is not checked")
	}
	dest := h.Dest("outage")
	before := message("k", `{"n":0}`)
	publish(t, h, []broker.Message{before}, []string{dest})

	h.Down()
	restored := false
	defer func() {
		if !restored {
			h.Up()
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	msgs := []broker.Message{message("k", `{"n":1}`), message("k", `{"n":2}`)}
	_, errs := h.Broker.Publish(ctx, msgs, []string{dest, dest})
	cancel()
	for i, err := range errs {
		switch {
		case err == nil:
			t.Fatalf("message %d published with the server down", i)
		case !h.Broker.Unavailable(err):
			t.Fatalf("message %d, server down: %v, and Unavailable says false (the relay would count an attempt for an outage)", i, err)
		}
	}
	ctx, cancel = context.WithTimeout(context.Background(), Timeout)
	err := h.Broker.Ping(ctx)
	cancel()
	if err == nil {
		t.Fatal("Ping answered with the server down")
	}

	h.Up()
	restored = true
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), Timeout)
		err := h.Broker.Ping(ctx)
		cancel()
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Ping 30s after the server came back: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	var ids []string
	for {
		ctx, cancel := context.WithTimeout(context.Background(), Timeout)
		var errs []error
		ids, errs = h.Broker.Publish(ctx, msgs, []string{dest, dest})
		cancel()
		err := errors.Join(errs...)
		if err == nil {
			break
		}
		if !h.Broker.Unavailable(err) || time.Now().After(deadline) {
			t.Fatalf("Publish after the server came back: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	// What failed while the server was down may have arrived (MaybeSent):
	// the checks ask only for what was published after, in order.
	got := read(t, h, dest)
	if len(got) < 3 {
		t.Fatalf("%s holds %d messages, want the one before the outage and the two after", dest, len(got))
	}
	expect(t, dest, got[len(got)-2:], msgs, ids)
	if err := sameMessage(got[0], before); err != nil {
		t.Fatalf("the message before the outage: %v", err)
	}
}
