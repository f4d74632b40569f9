package consumer

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/tcpproxy"
)

// A consumer stalls past its name lease (cut from Redis),
// a supervisor starts a second process under the same name, and the first
// comes back. The first must stand down for good, and say so (Run returns
// ErrNameInUse); the partition changes hands once; every event takes
// effect once, in stream order, across the fight.
func TestTwinUnderOneNameStandsDown(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	cfg := testConfig(rdb, "same")
	cfg.Block = 100 * time.Millisecond
	cfg.PartitionLease = time.Second
	h := newRecorder(rdb.Client)

	proxy, viaProxy := proxied(t, rdb.Client)

	run := func(c *Consumer) (stop func(), done chan error) {
		ctx, cancel := context.WithCancel(context.Background())
		done = make(chan error, 1)
		go func() { done <- c.Run(ctx) }()
		return cancel, done
	}
	// The first's handler has maintenance of its own (as the inbox's
	// cleanup): standing down must stop it too.
	first, err := New(viaProxy, maintained{h}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	stopFirst, firstDone := run(first)
	t.Cleanup(stopFirst)
	outboxtest.Eventually(t, 5*time.Second, func() bool { return owns(rdb, first, 0) }, "the first consumer never took the stream")

	// Who holds the partition, as it changes.
	var mu sync.Mutex
	var holders []string
	watchCtx, stopWatch := context.WithCancel(context.Background())
	var watch sync.WaitGroup
	watch.Go(func() {
		for watchCtx.Err() == nil {
			v, _ := rdb.Get(watchCtx, first.parts[0].keys.Lease("test")).Result()
			mu.Lock()
			if v != "" && (len(holders) == 0 || holders[len(holders)-1] != v) {
				holders = append(holders, v)
			}
			mu.Unlock()
			time.Sleep(5 * time.Millisecond)
		}
	})
	t.Cleanup(func() { stopWatch(); watch.Wait() })

	// Events throughout: before the stall, during it, after it.
	const n = 150
	var pub sync.WaitGroup
	pub.Go(func() {
		for i := range n {
			publish(t, rdb, cfg.Stream, fmt.Sprintf("%04d", i))
			time.Sleep(20 * time.Millisecond)
		}
	})

	time.Sleep(300 * time.Millisecond)
	proxy.Down() // the first stalls: Redis unreachable for it
	second, err := New(rdb.Client, h, cfg)
	if err != nil {
		t.Fatal(err)
	}
	stopSecond, secondDone := run(second)
	t.Cleanup(stopSecond)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return owns(rdb, second, 0) }, "the second consumer never took the stream")
	time.Sleep(2500*time.Millisecond - time.Since(time.Now()))
	proxy.Up() // the first comes back

	select {
	case err := <-firstDone:
		if !errors.Is(err, ErrNameInUse) {
			t.Fatalf("the first consumer stopped with %v, want ErrNameInUse", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the first consumer, back from its stall, still runs next to the process that took its name")
	}
	pub.Wait()
	outboxtest.Eventually(t, 20*time.Second, func() bool { return len(h.effects()) >= n }, "applied %d of %d", len(h.effects()), n)
	time.Sleep(300 * time.Millisecond)
	if got := h.effects(); !slices.Equal(got, numbered(n)) {
		t.Fatalf("effects %v\nwant each event once, in stream order", got)
	}
	mu.Lock()
	changes := len(holders) - 1
	mu.Unlock()
	if changes != 1 || !owns(rdb, second, 0) {
		t.Fatalf("the partition changed hands %d times (%v), want once, to the second consumer", changes, holders)
	}
	select {
	case err := <-secondDone:
		t.Fatalf("the second consumer stopped: %v", err)
	default:
	}
}

// maintained is a recorder with maintenance that runs until its context
// ends (consumer.Maintainer).
type maintained struct{ *recorder }

func (maintained) Maintain(ctx context.Context) { <-ctx.Done() }

// slowOn is a recorder that takes its time over one aggregate's event
// (every event when agg is empty), and sends on begun (when set) as it
// starts one.
type slowOn struct {
	*recorder
	agg   string
	delay time.Duration
	begun chan struct{}
}

func (s slowOn) Handle(ctx context.Context, b Batch) []Result {
	for _, m := range b.Messages {
		if m.AggregateID == s.agg || s.agg == "" {
			if s.begun != nil {
				select {
				case s.begun <- struct{}{}:
				default:
				}
			}
			time.Sleep(s.delay)
		}
	}
	return s.recorder.Handle(ctx, b)
}

// An entry a twin under this consumer's name read (and never acknowledged:
// its effects are fenced) is applied by the partition's owner before the
// entries after it, not left in the name's pending list until it idles out.
func TestEntryATwinReadIsAppliedInOrder(t *testing.T) {
	rdb, cfg, h := twinReadsE2(t, 30*time.Second)
	publish(t, rdb, cfg.Stream, "e3")
	for deadline := time.Now().Add(10 * time.Second); len(h.effects()) < 3 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	if got := h.effects(); !slices.Equal(got, []string{"e1", "e2", "e3"}) {
		t.Fatalf("applied %v, want e1, e2, e3", got)
	}
}

// The same with no entry after the one the twin read: the owner learns of
// it when its read comes back empty, within a Config.Block, not when it has
// idled ClaimMinIdle (a twin back from a stall reading the partition's last
// entries left them there for 30 s, and the next entries of their keys could
// be applied first).
func TestEntryATwinReadLastIsAppliedWithinABlock(t *testing.T) {
	_, _, h := twinReadsE2(t, time.Minute)
	read := time.Now()
	for len(h.effects()) < 2 && time.Since(read) < 5*time.Second {
		time.Sleep(10 * time.Millisecond)
	}
	if got := h.effects(); !slices.Equal(got, []string{"e1", "e2"}) {
		t.Fatalf("%s after the twin read e2, applied %v, want e1, e2", time.Since(read).Round(time.Millisecond), got)
	}
}

// twinReadsE2 runs a consumer "same" that owns the stream and applies e1
// slowly; while it does, e2 is published and a twin under its name reads it
// (and goes away). claimMinIdle is the consumer's.
func twinReadsE2(t *testing.T, claimMinIdle time.Duration) (outboxtest.Redis, Config, *recorder) {
	t.Helper()
	rdb := outboxtest.NewRedis(t)
	cfg := testConfig(rdb, "same")
	cfg.Block = 100 * time.Millisecond
	cfg.ClaimMinIdle = claimMinIdle
	h := newRecorder(rdb.Client)
	begun := make(chan struct{}, 1)
	c, err := New(rdb.Client, slowOn{recorder: h, agg: "e1", delay: 500 * time.Millisecond, begun: begun}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	outboxtest.Eventually(t, 5*time.Second, func() bool { return owns(rdb, c, 0) }, "the consumer never took the stream")

	publish(t, rdb, cfg.Stream, "e1")
	select { // the owner is applying e1, slowly: not reading
	case <-begun:
	case <-time.After(10 * time.Second):
		t.Fatal("the owner never began to apply e1")
	}
	publish(t, rdb, cfg.Stream, "e2")
	res, err := rdb.XReadGroup(context.Background(), &redis.XReadGroupArgs{
		Group: "test", Consumer: "same", Streams: []string{cfg.Stream, ">"}, Count: 1, Block: -1,
	}).Result()
	if err != nil || len(res) != 1 || len(res[0].Messages) != 1 || res[0].Messages[0].Values["aggregate_id"] != "e2" {
		t.Fatalf("the twin's read: %v (%v), want e2", res, err)
	}
	return rdb, cfg, h
}

// proxied returns a client of rdb's server through a proxy of its own, which
// the test can cut (Down) or blackhole (Freeze) for that client alone.
func proxied(t *testing.T, rdb *redis.Client) (*tcpproxy.Proxy, *redis.Client) {
	t.Helper()
	proxy, err := tcpproxy.Start(rdb.Options().Addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { proxy.Close() })
	opt := *rdb.Options()
	opt.Addr, opt.MaxRetries = proxy.Addr(), -1
	c := redis.NewClient(&opt)
	t.Cleanup(func() { c.Close() })
	return proxy, c
}

// numbered is "0000", "0001", ... up to n events' aggregate ids.
func numbered(n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("%04d", i)
	}
	return ids
}
