// Package sourcetest checks a source.Source against what the consumer
// expects of it, on a real server: a team reading from a broker of its own
// runs the same checks as Redis Streams' source (package consumer) and
// JetStream's (consumer/natssource).
//
//	func TestSource(t *testing.T) {
//		sourcetest.Run(t, func(t *testing.T) sourcetest.Harness {
//			return sourcetest.Harness{
//				Source:  func(consumer string) source.Source { return newMySource(t, consumer) },
//				Subject: func(name string) string { return myPrefix(t) + name },
//				Publish: func(ctx context.Context, subject string, fields map[string]string) error { ... },
//			}
//		})
//	}
//
// The checks: a partition's messages come in the order published, with
// their fields; what was acknowledged or terminated does not come again;
// what an owner left unacknowledged comes first to the next owner, in
// order, before anything newer; a message negatively acknowledged comes
// again; what an owner still reading gets after a newer owner opened the
// partition reaches the newer owner; Backlog counts what is delivered and
// not acknowledged, and what is not delivered yet; Ping answers. A consumer
// built on a source that passes them keeps its guarantees; the consumer's
// own tests and internal/conformance check the rest with relays and
// consumers running.
package sourcetest

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/tedbank/outbox/consumer/source"
	"github.com/tedbank/outbox/relay/entry"
)

// Harness is one test's source and what the checks need around it.
type Harness struct {
	// Source returns the source under test as a consumer of that name
	// sees it (each owner of a partition in the checks has its own).
	Source func(consumer string) source.Source
	// Subject returns a subject (a stream) of this test's own for a short
	// lowercase name: a partition the checks publish to and read.
	Subject func(name string) string
	// Publish appends a message with fields (package relay/entry's names,
	// entry.Payload the payload) to subject, as the relay publishes it.
	Publish func(ctx context.Context, subject string, fields map[string]string) error
}

// Timeout bounds each wait of the checks for a message.
const Timeout = 10 * time.Second

// block is how long a read that expects nothing waits.
const block = 300 * time.Millisecond

// Run runs every check as a subtest, each with a harness of its own.
func Run(t *testing.T, newHarness func(t *testing.T) Harness) {
	t.Helper()
	for _, c := range []struct {
		name  string
		check func(t *testing.T, k *kit)
	}{
		{"OrderAndFields", checkOrderAndFields},
		{"AcknowledgedDoNotComeAgain", checkAcknowledged},
		{"UnacknowledgedComeFirstToTheNextOwner", checkTakeover},
		{"NakedComeAgain", checkNak},
		{"TerminatedDoNotComeAgain", checkTerm},
		{"LateReadsOfAnEarlierOwnerReachTheNewOwner", checkLateReads},
		{"Backlog", checkBacklog},
		{"Ping", checkPing},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t)
			if h.Source == nil || h.Subject == nil || h.Publish == nil {
				t.Fatal("sourcetest: the harness needs Source, Subject and Publish")
			}
			c.check(t, &kit{t: t, h: h, group: "kit"})
		})
	}
}

// kit is one check's harness and helpers.
type kit struct {
	t     *testing.T
	h     Harness
	group string
	epoch int64
}

// publish publishes n messages to subject, their payloads tag-1..tag-n,
// and returns the payloads in order.
func (k *kit) publish(subject, tag string, n int) []string {
	k.t.Helper()
	var payloads []string
	for i := 1; i <= n; i++ {
		p := tag + "-" + strconv.Itoa(i)
		fields := map[string]string{
			entry.EventID: uuid.NewString(), entry.EventType: "kit.checked", entry.AggregateID: tag,
			entry.PartitionKey: tag, entry.Payload: `{"n":` + strconv.Itoa(i) + `,"tag":"` + tag + `"}`,
		}
		fields["kit"] = p
		ctx, cancel := context.WithTimeout(context.Background(), Timeout)
		err := k.h.Publish(ctx, subject, fields)
		cancel()
		if err != nil {
			k.t.Fatalf("publish %s to %s: %v", p, subject, err)
		}
		payloads = append(payloads, p)
	}
	return payloads
}

// open opens subject's partition for a new owner named consumer, with a
// greater epoch than every owner before it in the check.
func (k *kit) open(consumer, subject string) source.Reader {
	k.t.Helper()
	k.epoch++
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	rd, err := k.h.Source(consumer).Open(ctx, source.Partition{
		Group: k.group, Subject: subject, N: 0, Epoch: k.epoch, Owner: fmt.Sprintf("%d|%s|kit", k.epoch, consumer),
		AckWait: time.Minute, MaxAckPending: 100,
	})
	if err != nil {
		k.t.Fatalf("open %s for %s: %v", subject, consumer, err)
	}
	return rd
}

// read reads until n messages came, or Timeout passed.
func (k *kit) read(rd source.Reader, n int) []source.Message {
	k.t.Helper()
	var got []source.Message
	deadline := time.Now().Add(Timeout)
	for len(got) < n && time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), Timeout)
		msgs, err := rd.Read(ctx, n-len(got), 500*time.Millisecond)
		cancel()
		if err != nil {
			k.t.Fatalf("read after %d of %d messages: %v", len(got), n, err)
		}
		got = append(got, msgs...)
	}
	if len(got) < n {
		k.t.Fatalf("read %d messages (%v) within %s, want %d", len(got), kitNames(got), Timeout, n)
	}
	return got
}

// readNothing reads for a while and fails if anything comes.
func (k *kit) readNothing(rd source.Reader, why string) {
	k.t.Helper()
	for range 3 {
		ctx, cancel := context.WithTimeout(context.Background(), Timeout)
		msgs, err := rd.Read(ctx, 10, block)
		cancel()
		if err != nil {
			k.t.Fatalf("read: %v", err)
		}
		if len(msgs) > 0 {
			k.t.Fatalf("read %v: %s", kitNames(msgs), why)
		}
	}
}

func (k *kit) flush(rd source.Reader) {
	k.t.Helper()
	if err := rd.Flush(Timeout); err != nil {
		k.t.Fatalf("flush: %v", err)
	}
}

func (k *kit) ack(msgs ...source.Message) {
	k.t.Helper()
	for _, m := range msgs {
		if err := m.Ack(); err != nil {
			k.t.Fatalf("ack %s: %v", m.ID(), err)
		}
	}
}

// kitName is the name the check gave a message.
func kitName(m source.Message) string {
	s, _ := m.Values()["kit"].(string)
	return s
}

func kitNames(msgs []source.Message) []string {
	names := make([]string, len(msgs))
	for i, m := range msgs {
		names[i] = kitName(m)
	}
	return names
}

func checkOrderAndFields(t *testing.T, k *kit) {
	subject := k.h.Subject("order")
	want := k.publish(subject, "order", 5)
	rd := k.open("a", subject)
	got := k.read(rd, 5)
	if fmt.Sprint(kitNames(got)) != fmt.Sprint(want) {
		t.Fatalf("read %v, want %v (the order published)", kitNames(got), want)
	}
	ids := map[string]bool{}
	for i, m := range got {
		v := m.Values()
		for _, f := range []string{entry.EventID, entry.EventType, entry.AggregateID, entry.PartitionKey, entry.Payload} {
			if s, ok := v[f].(string); !ok || s == "" {
				t.Errorf("message %s: field %s is %#v, want the string published", kitName(m), f, v[f])
			}
		}
		if p, want := v[entry.Payload], `{"n":`+strconv.Itoa(i+1)+`,"tag":"order"}`; p != want {
			t.Errorf("message %s: payload %#v, want %q", kitName(m), p, want)
		}
		if m.Subject() != subject {
			t.Errorf("message %s: subject %q, want %q", kitName(m), m.Subject(), subject)
		}
		if m.Deliveries() != 1 {
			t.Errorf("message %s: deliveries %d, want 1 (its first)", kitName(m), m.Deliveries())
		}
		if m.ID() == "" || ids[m.ID()] {
			t.Errorf("message %s: id %q empty or not unique", kitName(m), m.ID())
		}
		ids[m.ID()] = true
	}
	k.ack(got...)
	k.flush(rd)
}

func checkAcknowledged(t *testing.T, k *kit) {
	subject := k.h.Subject("acked")
	k.publish(subject, "acked", 3)
	rd := k.open("a", subject)
	k.ack(k.read(rd, 3)...)
	k.flush(rd)
	k.readNothing(k.open("b", subject), "acknowledged messages came again to the next owner")
}

func checkTakeover(t *testing.T, k *kit) {
	subject := k.h.Subject("takeover")
	want := k.publish(subject, "takeover", 6)
	a := k.open("a", subject)
	got := k.read(a, 6)
	k.ack(got[:2]...) // then a stops: the other four are unacknowledged
	k.flush(a)
	b := k.open("b", subject)
	later := k.publish(subject, "later", 1)
	again := k.read(b, 5)
	if fmt.Sprint(kitNames(again)) != fmt.Sprint(append(want[2:], later...)) {
		t.Fatalf("the next owner read %v, want %v: what the earlier owner left unacknowledged first, in order, then what is newer",
			kitNames(again), append(want[2:], later...))
	}
	k.ack(again...)
	k.flush(b)
}

func checkNak(t *testing.T, k *kit) {
	subject := k.h.Subject("nak")
	want := k.publish(subject, "nak", 2)
	a := k.open("a", subject)
	got := k.read(a, 2)
	if err := got[0].Nak(10 * time.Millisecond); err != nil {
		t.Fatalf("nak: %v", err)
	}
	k.flush(a)
	// At the latest when the partition is opened again (the consumer opens
	// it again after a failure): first, before anything after it.
	b := k.open("b", subject)
	again := k.read(b, 1)
	if kitName(again[0]) != want[0] {
		t.Fatalf("after a nak the next owner read %v first, want %s", kitNames(again), want[0])
	}
	if again[0].Deliveries() < 1 {
		t.Fatalf("deliveries %d", again[0].Deliveries())
	}
}

func checkTerm(t *testing.T, k *kit) {
	subject := k.h.Subject("term")
	k.publish(subject, "term", 2)
	a := k.open("a", subject)
	got := k.read(a, 2)
	if err := got[0].Term(); err != nil {
		t.Fatalf("term: %v", err)
	}
	k.ack(got[1])
	k.flush(a)
	k.readNothing(k.open("b", subject), "a terminated message came again")
}

func checkLateReads(t *testing.T, k *kit) {
	subject := k.h.Subject("late")
	k.publish(subject, "early", 1)
	a := k.open("a", subject)
	k.ack(k.read(a, 1)...)
	k.flush(a)
	b := k.open("b", subject) // a has not noticed yet
	k.readNothing(b, "an acknowledged message came again to the next owner")
	want := k.publish(subject, "late", 2)
	// a reads on, as an owner that has not noticed its lease is gone does
	// (its effects are fenced: it settles nothing); what it gets, if
	// anything, must reach b too.
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	_, _ = a.Read(ctx, 10, block)
	cancel()
	got := k.read(b, 2)
	if fmt.Sprint(kitNames(got)) != fmt.Sprint(want) {
		t.Fatalf("the new owner read %v, want %v (what the earlier owner read late included, in order)", kitNames(got), want)
	}
	k.ack(got...)
	k.flush(b)
}

func checkBacklog(t *testing.T, k *kit) {
	subject := k.h.Subject("backlog")
	k.publish(subject, "backlog", 3)
	src := k.h.Source("a")
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	if _, _, found, err := src.Backlog(ctx, k.group, subject, 0); err != nil || found {
		t.Fatalf("backlog before the partition was opened: found %v, %v; want not found", found, err)
	}
	rd := k.open("a", subject)
	got := k.read(rd, 3)
	k.ack(got[0])
	k.flush(rd)
	k.publish(subject, "more", 1)
	deadline := time.Now().Add(Timeout)
	for {
		pending, lag, found, err := src.Backlog(ctx, k.group, subject, 0)
		if err != nil {
			t.Fatalf("backlog: %v", err)
		}
		if found && pending == 2 && lag == 1 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("backlog: pending %d, lag %d, found %v; want 2 delivered and not acknowledged, 1 not delivered", pending, lag, found)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func checkPing(t *testing.T, k *kit) {
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	if err := k.h.Source("a").Ping(ctx); err != nil {
		t.Fatalf("ping: %v", err)
	}
}
