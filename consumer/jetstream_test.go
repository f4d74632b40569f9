package consumer

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/tedbank/outbox/internal/natsjs"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/tcpproxy"
	"github.com/tedbank/outbox/relay/entry"
)

// jsEnv is a JetStream stream of the test's own, with the subjects of its
// Redis prefix.
type jsEnv struct {
	t   *testing.T
	rdb outboxtest.Redis
	js  jetstream.JetStream
	cfg Config
}

func newJSEnv(t *testing.T) *jsEnv {
	t.Helper()
	rdb := outboxtest.NewRedis(t)
	nc, js, err := natsjs.Connect(outboxtest.NATSURL(t), "outbox-test")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	prefix := rdb.Prefix + "outbox.event."
	if _, err := natsjs.Ensure(context.Background(), js, natsjs.Stream{Name: outboxtest.NATSStream(t), SubjectPrefix: prefix}); err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(rdb, "c1")
	cfg.Stream = prefix + "thing"
	cfg.Block = 100 * time.Millisecond
	cfg.MaxDeliveries = 2
	return &jsEnv{t: t, rdb: rdb, js: js, cfg: cfg}
}

// publish publishes an event of aggregate agg as the relay does, under its
// own Nats-Msg-Id (a re-publication past the duplicate window: the
// consumer must skip it), and returns its id.
func (e *jsEnv) publish(id uuid.UUID, agg string) {
	e.t.Helper()
	_, err := e.js.PublishMsg(context.Background(), &nats.Msg{Subject: e.cfg.Stream, Data: []byte(`{}`), Header: nats.Header{
		jetstream.MsgIDHeader: {uuid.NewString()}, entry.EventID: {id.String()}, entry.EventType: {"test.happened"},
		entry.AggregateType: {"test"}, entry.AggregateID: {agg}, entry.Headers: {"{}"},
	}})
	if err != nil {
		e.t.Fatal(err)
	}
}

// run runs a consumer of h until the test ends.
func (e *jsEnv) run(h Handler, name string) *Consumer {
	e.t.Helper()
	cfg := e.cfg
	cfg.Consumer = name
	c, err := NewJetStream(e.rdb.Client, e.js, h, cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	e.t.Cleanup(func() { cancel(); <-done })
	return c
}

// Read from JetStream, every event's effect is applied once, in stream
// order, whatever it was published (a copy under another Nats-Msg-Id is a
// duplicate), and every message acknowledged.
func TestJetStreamConsumerAppliesEachEventOnce(t *testing.T) {
	e := newJSEnv(t)
	h := newRecorder(e.rdb.Client)
	var ids []uuid.UUID
	for i := range 10 {
		ids = append(ids, uuid.New())
		e.publish(ids[i], fmt.Sprint(i))
	}
	e.publish(ids[3], "3") // again
	c := e.run(h, "c1")
	outboxtest.Eventually(t, 10*time.Second, func() bool { return c.Stats().Processed == 10 && c.Stats().Duplicates == 1 },
		"stats %+v, want 10 applied and 1 duplicate", c.Stats())
	if got := fmt.Sprint(h.effects()); got != "[0 1 2 3 4 5 6 7 8 9]" {
		t.Fatalf("effects %s, want each once in stream order", got)
	}
	stream, _ := e.js.StreamNameBySubject(context.Background(), e.cfg.Stream)
	outboxtest.Eventually(t, 5*time.Second, func() bool {
		cons, err := e.js.Consumer(context.Background(), stream, c.durable(c.parts[0]))
		return err == nil && cons.CachedInfo().NumAckPending == 0 && cons.CachedInfo().AckFloor.Stream == 11
	}, "not every message acknowledged")
}

// A new owner of a partition applies what the previous one received and
// never acknowledged before anything newer: the partition's order holds
// across a crash.
func TestJetStreamNewOwnerAppliesTheUnacknowledgedFirst(t *testing.T) {
	e := newJSEnv(t)
	h := newRecorder(e.rdb.Client)
	for i := range 3 {
		e.publish(uuid.New(), fmt.Sprint("early-", i))
	}
	// An earlier owner read them and died before acknowledging: its
	// durable is left with them pending (their AckWait, 30s, far away).
	ctx := context.Background()
	old, err := NewJetStream(e.rdb.Client, e.js, h, e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	cons, err := old.takeOverJetStream(ctx, old.parts[0])
	if err != nil {
		t.Fatal(err)
	}
	batch, err := cons.Fetch(3, jetstream.FetchMaxWait(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	read := 0
	for range batch.Messages() {
		read++
	}
	if read != 3 {
		t.Fatalf("the earlier owner read %d, want 3", read)
	}
	e.publish(uuid.New(), "late-0")
	e.publish(uuid.New(), "late-1")
	second := e.run(h, "new")
	outboxtest.Eventually(t, 15*time.Second, func() bool { return second.Stats().Processed == 5 },
		"the new owner applied %v, want 5", h.effects())
	if got := fmt.Sprint(h.effects()); got != "[early-0 early-1 early-2 late-0 late-1]" {
		t.Fatalf("effects %s, want the unacknowledged ones first, in stream order", got)
	}
}

// A message whose effect fails transiently is delivered again, with
// backoff, until it applies; one that can never apply is moved to the
// partition's dead-letter stream in Redis at its last delivery and
// terminated.
func TestJetStreamFailuresRetriedOrDeadLettered(t *testing.T) {
	e := newJSEnv(t)
	var mu sync.Mutex
	flaky := 2
	inner := newRecorder(e.rdb.Client)
	h := HandlerFunc(func(ctx context.Context, b Batch) []Result {
		mu.Lock()
		defer mu.Unlock()
		res := make([]Result, len(b.Messages))
		pass := b
		pass.Messages = nil
		var idx []int
		for i, m := range b.Messages {
			switch {
			case m.AggregateID == "poison":
				res[i].Err = Invalid("never applies")
			case m.AggregateID == "flaky" && flaky > 0:
				flaky--
				res[i].Err = errors.New("store busy")
			default:
				pass.Messages = append(pass.Messages, m)
				idx = append(idx, i)
			}
		}
		for j, r := range inner.Handle(ctx, pass) {
			res[idx[j]] = r
		}
		return res
	})
	poison := uuid.New()
	e.publish(poison, "poison")
	e.publish(uuid.New(), "flaky")
	e.publish(uuid.New(), "fine")
	c := e.run(h, "c1")
	outboxtest.Eventually(t, 15*time.Second, func() bool { return c.Stats().DeadLettered == 1 && c.Stats().Processed == 2 },
		"stats %+v: want the poison dead-lettered, the others applied", c.Stats())
	dlq, err := e.rdb.XRange(context.Background(), e.rdb.Prefix+"test:dlq", "-", "+").Result()
	if err != nil || len(dlq) != 1 || dlq[0].Values["event_id"] != poison.String() || dlq[0].Values["dlq_broker"] != "nats" ||
		dlq[0].Values["dlq_deliveries"] != "2" {
		t.Fatalf("dead letters %v (%v): want the poison event after its 2 deliveries, from nats", dlq, err)
	}
	if got := fmt.Sprint(inner.effects()); got != "[flaky fine]" && got != "[fine flaky]" {
		t.Fatalf("effects %s: want the flaky message applied after its failures, and the fine one", got)
	}
	if st := c.Stats(); st.Failed < 4 {
		t.Fatalf("stats %+v: want at least 4 failures (the flaky message's 2, the poison's 2 deliveries)", st)
	}
}

// A consumer whose connection to NATS goes silent (half-open) notices from
// its blocking fetch, which the server no longer ends, reconnects, and reads
// the partition again from its ack floor (the event the server sent into the
// silent connection would otherwise wait out its ack wait), without waiting
// for the pings.
func TestJetStreamConsumerReplacesAHalfOpenConnection(t *testing.T) {
	e := newJSEnv(t)
	px, err := tcpproxy.Start(strings.TrimPrefix(outboxtest.NATSURL(t), "nats://"))
	if err != nil {
		t.Fatal(err)
	}
	defer px.Close()
	nc, js, err := natsjs.Connect("nats://"+px.Addr(), "outbox-test-proxied")
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	h := newRecorder(e.rdb.Client)
	cfg := e.cfg
	cfg.Block = time.Second
	c, err := NewJetStream(e.rdb.Client, js, h, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	defer func() { cancel(); <-done }()
	e.publish(uuid.New(), "before")
	outboxtest.Eventually(t, 10*time.Second, func() bool { return c.Stats().Processed == 1 }, "the first event was not applied")
	time.Sleep(200 * time.Millisecond) // the consumer waits in its blocking fetch
	px.Freeze()
	e.publish(uuid.New(), "after") // through the test's own connection
	started := time.Now()
	outboxtest.Eventually(t, 10*time.Second, func() bool { return c.Stats().Processed == 2 }, "the event published after the freeze was not applied")
	// The pings alone would take about 6s.
	if took := time.Since(started); took > 4*time.Second {
		t.Fatalf("applied %s after the freeze: the consumer waited for the pings", took)
	}
}

// A message whose effect fails transiently is applied again before the
// messages after it: a sender's order holds across the failure.
func TestJetStreamTransientFailureKeepsOrder(t *testing.T) {
	e := newJSEnv(t)
	e.cfg.BatchSize = 1 // the two messages in two batches
	var mu sync.Mutex
	failed := false
	inner := newRecorder(e.rdb.Client)
	h := HandlerFunc(func(ctx context.Context, b Batch) []Result {
		mu.Lock()
		defer mu.Unlock()
		if !failed && b.Messages[0].AggregateID == "first" {
			failed = true
			return []Result{{Err: errors.New("store busy")}}
		}
		return inner.Handle(ctx, b)
	})
	e.publish(uuid.New(), "first")
	e.publish(uuid.New(), "second")
	c := e.run(h, "c1")
	outboxtest.Eventually(t, 10*time.Second, func() bool { return c.Stats().Processed == 2 }, "stats %+v", c.Stats())
	if got := fmt.Sprint(inner.effects()); got != "[first second]" {
		t.Fatalf("effects %s: the message after the failed one was applied first", got)
	}
}
