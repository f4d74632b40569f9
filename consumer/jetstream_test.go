package consumer

import (
	"context"
	"errors"
	"fmt"
	"github.com/tedbank/outbox/consumer/natssource"
	"slices"
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
	c, err := NewWithSource(e.rdb.Client, natssource.New(e.js), h, cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(start(c))
	return c
}

// start runs c in the background; stop cancels it and waits for Run to
// return.
func start(c *Consumer) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	return func() { cancel(); <-done }
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
		cons, err := natssource.Durable(context.Background(), e.js, stream, "test", 0)
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
	old, err := NewWithSource(e.rdb.Client, natssource.New(e.js), h, e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	oldFeed := old.takeOver(t, 0)
	rd, err := old.open(ctx, oldFeed)
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := rd.Read(ctx, 3, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if read := len(msgs); read != 3 {
		t.Fatalf("the earlier owner read %d, want 3", read)
	}
	e.publish(uuid.New(), "late-0")
	e.publish(uuid.New(), "late-1")
	old.expire(t, oldFeed) // it died: its lease runs out
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
	c, err := NewWithSource(e.rdb.Client, natssource.New(js), h, cfg)
	if err != nil {
		t.Fatal(err)
	}
	c.reading.Init()
	defer start(c)()
	e.publish(uuid.New(), "before")
	outboxtest.Eventually(t, 10*time.Second, func() bool { return c.Stats().Processed == 1 }, "the first event was not applied")
	c.reading.Clear() // the consumer waits in its blocking fetch, the next after the first event
	if _, err := c.reading.WaitFor(10*time.Second, nil); err != nil {
		t.Fatal(err)
	}
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

// A partition owner cut from Redis (its lease store)
// while NATS stays reachable loses its lease to another consumer. It must
// not go on fetching from the partition's durable: what it fetched would
// wait out its ack wait while the new owner applies the messages after
// them. Every event takes effect once, in stream order.
func TestJetStreamStaleOwnerReadsNothingOfTheNewOwners(t *testing.T) {
	e := newJSEnv(t)
	e.cfg.PartitionLease = time.Second
	// Its fence check reaches Redis, as the inbox's reaches PostgreSQL;
	// 25 ms an effect, as a real store's.
	h := slowOn{recorder: newRecorder(e.rdb.Client), delay: 25 * time.Millisecond}
	proxy, viaProxy := proxied(t, e.rdb.Client)

	cfg := e.cfg
	cfg.Consumer = "a"
	a, err := NewWithSource(viaProxy, natssource.New(e.js), h, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = a.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	outboxtest.Eventually(t, 5*time.Second, func() bool { return owns(e.rdb, a, 0) }, "a never took the partition")
	b := e.run(h, "b") // stands by: one partition, two members

	const n = 300
	var pub sync.WaitGroup
	pub.Go(func() {
		for i := range n {
			e.publish(uuid.New(), fmt.Sprintf("%04d", i))
			time.Sleep(10 * time.Millisecond)
		}
	})
	time.Sleep(500 * time.Millisecond)
	proxy.Down() // a is cut from Redis; NATS and the effects' store stay reachable
	outboxtest.Eventually(t, 10*time.Second, func() bool { return owns(e.rdb, b, 0) }, "b never took the partition over")
	pub.Wait()
	for deadline := time.Now().Add(15 * time.Second); len(h.effects()) < n && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	got, want := h.effects(), numbered(n)
	if !slices.Equal(got, want) {
		late := 0
		for i := 1; i < len(got); i++ {
			if got[i] < got[i-1] {
				late++
			}
		}
		t.Fatalf("%d effects, %d of them after a later one: want each of the %d once, in stream order\n%v", len(got), late, n, got)
	}
}

// takeOver takes partition p's lease for c, as its ownership loop does, and
// returns the partition as c's worker would apply it.
func (c *Consumer) takeOver(t *testing.T, p int) feed {
	t.Helper()
	fence, err := c.group.lease(context.Background(), c.parts[p])
	if err != nil || fence == "" {
		t.Fatalf("take partition %d's lease: %q, %v", p, fence, err)
	}
	return feed{part: c.parts[p], fence: fence}
}

// expire ends f's lease, as if it ran out.
func (c *Consumer) expire(t *testing.T, f feed) {
	t.Helper()
	if err := releaseScript.Run(context.Background(), c.rdb, []string{f.keys.Lease(c.cfg.Group)}, f.fence).Err(); err != nil {
		t.Fatal(err)
	}
}

// An owner that lost its partition and has not noticed yet fetches nothing
// of the new owner's: each owner reads through a durable of its own epoch,
// and the new owner's takeover deletes the old one.
func TestJetStreamOldOwnersDurableFetchesNothingNew(t *testing.T) {
	e := newJSEnv(t)
	ctx := context.Background()
	h := newRecorder(e.rdb.Client)
	cfgA, cfgB := e.cfg, e.cfg
	cfgA.Consumer, cfgB.Consumer = "a", "b"
	a, err := NewWithSource(e.rdb.Client, natssource.New(e.js), h, cfgA)
	if err != nil {
		t.Fatal(err)
	}
	b, err := NewWithSource(e.rdb.Client, natssource.New(e.js), h, cfgB)
	if err != nil {
		t.Fatal(err)
	}
	fa := a.takeOver(t, 0)
	rdA, err := a.open(ctx, fa)
	if err != nil {
		t.Fatal(err)
	}
	a.expire(t, fa) // a stalls past its lease
	fb := b.takeOver(t, 0)
	rdB, err := b.open(ctx, fb)
	if err != nil {
		t.Fatal(err)
	}
	e.publish(uuid.New(), "after-takeover")
	stolen, _ := rdA.Read(ctx, 1, 300*time.Millisecond)
	if stolen := len(stolen); stolen != 0 {
		t.Fatalf("the old owner's handle fetched %d message(s) of the new owner's", stolen)
	}
	msgs, err := rdB.Read(ctx, 1, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if got := len(msgs); got != 1 {
		t.Fatalf("the new owner fetched %d, want the message", got)
	}
	// The old owner, retaking the partition, is fenced: its lease is gone.
	if _, err := a.open(ctx, fa); !errors.Is(err, ErrFenced) {
		t.Fatalf("the old owner's takeover after losing its lease: %v, want ErrFenced", err)
	}
	stream, _ := e.js.StreamNameBySubject(ctx, e.cfg.Stream)
	if cur, err := natssource.Durable(ctx, e.js, stream, "test", 0); err != nil || cur.CachedInfo().Name != natssource.DurableNameOf("test", 0, mustEpoch(t, fb.fence)) {
		t.Fatalf("the partition's durable: %v (%v), want the new owner's", cur, err)
	}
}

func mustEpoch(t *testing.T, fence string) int64 {
	t.Helper()
	e, err := leaseEpoch(fence)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// ttlRecorder is a recorder that says how long it keeps its records.
type ttlRecorder struct {
	*recorder
	ttl time.Duration
}

func (r ttlRecorder) DedupeTTL() time.Duration { return r.ttl }

// A partition read again from the stream's first message (its durables
// gone) would deliver every message the stream keeps: dedupe records kept
// less long than that are refused when the consumer starts.
func TestJetStreamDedupeRecordsMustOutliveTheStream(t *testing.T) {
	e := newJSEnv(t) // the stream keeps messages natsjs.DefaultMaxAge, 7 days
	short, err := NewWithSource(e.rdb.Client, natssource.New(e.js), ttlRecorder{newRecorder(e.rdb.Client), 2 * time.Hour}, e.cfg)
	if err != nil {
		t.Fatalf("2h of records against the relays' redelivery window: %v", err)
	}
	if err := short.Run(context.Background()); !errors.Is(err, ErrConfig) {
		t.Fatalf("records kept 2h on a stream that keeps messages 7 days: %v, want ErrConfig", err)
	}
	long, err := NewWithSource(e.rdb.Client, natssource.New(e.js), ttlRecorder{newRecorder(e.rdb.Client), natsjs.DefaultMaxAge}, e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	if err := long.Run(ctx); err != nil {
		t.Fatalf("records kept as long as the stream's messages: %v", err)
	}
}

// natsjs.Ensure, as relays starting together call it: every call succeeds,
// the stream is created once, an identical one is left alone, and a change
// of settings updates it. (Relays that sent an update beside a create
// crashed nats-server 2.9.10 in the chaos suite.)
func TestEnsureCreatesTheStreamOnceAndUpdatesOnlyAChange(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	nc, js, err := natsjs.Connect(outboxtest.NATSURL(t), "outbox-test")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	s := natsjs.Stream{Name: outboxtest.NATSStream(t), SubjectPrefix: rdb.Prefix + "outbox.event."}
	ctx := context.Background()
	errs := make(chan error, 8)
	for range 8 {
		go func() { _, err := natsjs.Ensure(ctx, js, s); errs <- err }()
	}
	for range 8 {
		if err := <-errs; err != nil {
			t.Fatalf("Ensure beside seven others: %v", err)
		}
	}
	st, err := js.Stream(ctx, s.Name)
	if err != nil || st.CachedInfo().Config.MaxAge != natsjs.DefaultMaxAge {
		t.Fatalf("stream after the creates: %v, max age %v", err, st.CachedInfo().Config.MaxAge)
	}
	s.MaxAge = 48 * time.Hour
	if _, err := natsjs.Ensure(ctx, js, s); err != nil {
		t.Fatal(err)
	}
	if st, err = js.Stream(ctx, s.Name); err != nil || st.CachedInfo().Config.MaxAge != 48*time.Hour {
		t.Fatalf("stream after a change: %v, max age %v, want 48h", err, st.CachedInfo().Config.MaxAge)
	}
}

// nats-server restarts (killed, back on its port with its store) while a
// consumer waits in a blocking fetch. The fetch's pull request died with the
// server, and nothing would end it before its own timer: the consumer must
// notice that its connection came back, and read the partition again at
// once. (The chaos suite's effects waited up to 2 s after a nats-kill or a
// nats-restart.)
func TestJetStreamConsumerIsBackAtOnceAfterTheServerRestarts(t *testing.T) {
	t.Parallel()
	srv := outboxtest.OwnNATS(t)
	rdb := outboxtest.NewRedis(t)
	nc, js, err := natsjs.Connect(srv.URL, "outbox-test")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	prefix := rdb.Prefix + "outbox.event."
	if _, err := natsjs.Ensure(context.Background(), js, natsjs.Stream{Name: "OUTBOX", SubjectPrefix: prefix}); err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(rdb, "c1")
	cfg.Stream = prefix + "thing"
	// The pull request's own timer, which nothing else would shorten, well
	// past the restart (about 4 s here: JetStream recovers its store).
	cfg.Block, cfg.PartitionLease = 10*time.Second, 30*time.Second
	e := &jsEnv{t: t, rdb: rdb, js: js, cfg: cfg}
	h := newRecorder(rdb.Client)
	c, err := NewWithSource(rdb.Client, natssource.New(js), h, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(start(c))
	e.publish(uuid.New(), "before")
	outboxtest.Eventually(t, 10*time.Second, func() bool { return c.Stats().Processed == 1 }, "the first event was not applied")
	// The consumer waits in its blocking fetch: its pull request is at the
	// server.
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		d, err := natssource.Durable(context.Background(), js, "OUTBOX", c.cfg.Group, 0)
		if err != nil {
			return false
		}
		info, err := d.Info(context.Background())
		return err == nil && info.NumWaiting > 0
	}, "the consumer's fetch did not reach the server")
	killed := time.Now()
	if err := srv.Kill(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second) // down a second, as the chaos suite's nats-kill
	if err := srv.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	back := time.Now()
	t.Logf("the server was back %s after the kill", back.Sub(killed).Round(time.Millisecond))
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		_, err := js.AccountInfo(context.Background())
		return err == nil
	}, "the test's own connection did not come back")
	e.publish(uuid.New(), "after")
	outboxtest.Eventually(t, 15*time.Second, func() bool { return c.Stats().Processed == 2 }, "the event published after the restart was not applied")
	took := time.Since(back)
	t.Logf("applied %s after the server was back", took.Round(time.Millisecond))
	if took > 1500*time.Millisecond {
		t.Errorf("the event published after the restart was applied %s after the server was back: the consumer waited out its fetch", took.Round(time.Millisecond))
	}
}
