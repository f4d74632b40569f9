package consumer

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/partition"
)

// A consumer process whose connections to Redis are gone (killed: the
// kernel closes them; here its proxy closes them) is dead to Redis: a process
// restarted under its name takes the name, and with it the partition, at once
// instead of waiting for the dead one's name lease (3 × Block + 1 s = 7 s).
func TestRestartUnderTheNameOfADeadProcessIsImmediate(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	cfg := testConfig(rdb, "same")
	cfg.Block = 2 * time.Second
	h := newRecorder(rdb.Client)
	proxy, viaProxy := proxied(t, rdb.Client)
	first, err := New(viaProxy, h, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go func() { _ = first.Run(ctx) }()
	outboxtest.Eventually(t, 5*time.Second, func() bool { return owns(rdb, first, 0) }, "the first consumer never took the stream")

	proxy.Down() // to Redis, the first process is gone
	key := first.keys.Consumer(first.cfg.Group, first.cfg.Consumer)
	if ttl := rdb.PTTL(context.Background(), key).Val(); ttl < 3*time.Second {
		t.Fatalf("the dead process's name lease has %s left: too little to tell a wait from none", ttl)
	}
	second, err := New(rdb.Client, h, cfg)
	if err != nil {
		t.Fatal(err)
	}
	started := time.Now()
	go func() { _ = second.Run(ctx) }()
	outboxtest.Eventually(t, 3*time.Second, func() bool { return owns(rdb, second, 0) },
		"the restarted consumer waited for the dead one's name lease")
	t.Logf("the restarted consumer owned the stream %s after it started", time.Since(started).Round(time.Millisecond))
}

// A member leaves: the others divide its partitions and their own anew. One
// of them must hand a partition over while its worker is blocked reading it
// (5 s here), and take the one the leaver gave back: it takes that one at
// once, and the partition's next event is applied within a second, not
// after the handed-over worker's read returns. (The .ci/run chaos suite
// found a consumer that took a freed partition only after it had stopped
// the ones it handed over: 2 s after a member left.)
func TestPartitionFreedIsTakenWhileAHandedOverOneFinishesItsRead(t *testing.T) {
	t.Parallel()
	rdb := outboxtest.NewRedis(t)
	h := newRecorder(rdb.Client)
	// Four partitions: with a, b, c, a wants 0 and 3, b 1, c 2; once c
	// has left, a wants 0 and 2, b 1 and 3.
	cfgOf := func(name string, block time.Duration) Config { return partitioned(rdb, name, 4, block) }
	start := func(cfg Config) (*Consumer, func()) {
		c := newGroupConsumer(t, rdb, h, cfg)
		if cfg.Consumer == "a" {
			c.reading.Init()
		}
		return c, runConsumer(t, c)
	}
	// a last: the others hand over to it at once (their reads block 100 ms).
	b, _ := start(cfgOf("b", 100*time.Millisecond))
	c, stopC := start(cfgOf("c", 100*time.Millisecond))
	outboxtest.Eventually(t, 10*time.Second, func() bool { return owns(rdb, b, 0) && owns(rdb, c, 1) },
		"b and c did not divide the partitions")
	a, _ := start(cfgOf("a", 5*time.Second))
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return owns(rdb, a, 0) && owns(rdb, a, 3) && owns(rdb, b, 1) && owns(rdb, c, 2)
	}, "the three consumers did not divide the four partitions")
	// a's worker of partition 3 is blocked in its read for 5 s from now.
	a.reading.Clear()
	if _, err := a.reading.WaitFor(10*time.Second, func(p int) bool { return p == 3 }); err != nil {
		t.Fatal(err)
	}
	stopC()
	published := time.Now()
	publishKeyed(t, rdb, c.parts[2].stream, "agg-2", keyOf(2, 4))
	outboxtest.Eventually(t, 10*time.Second, func() bool { return len(h.effects()) == 1 },
		"the event of the partition c gave back was not applied")
	took := time.Since(published)
	t.Logf("the event of the partition c gave back was applied %s after c stopped", took.Round(time.Millisecond))
	if !owns(rdb, a, 2) {
		t.Fatal("a did not take partition 2")
	}
	if took > time.Second {
		t.Errorf("the partition c gave back waited %s for its next owner: more than a second", took.Round(time.Millisecond))
	}
}

// A member joins: the one that owned every partition hands it half of them,
// while its worker of one handed over is blocked reading it (5 s here). The
// newcomer holds that partition within about a quarter second anyway (1.5 s
// allowed, for -race on a busy machine), and applies its next
// event: a worker told to stop does not finish the read's block first. (A
// rolling restart rebalances at every step: each partition handed over
// waited up to --block, 2 s, and twice when a member came back.)
func TestHandedOverPartitionMovesWhileItsWorkerIsBlockedInARead(t *testing.T) {
	t.Parallel()
	rdb := outboxtest.NewRedis(t)
	h := newRecorder(rdb.Client)
	// Two partitions: a alone wants both; with b, a wants 0 and b 1.
	cfgOf := func(name string, block time.Duration) Config { return partitioned(rdb, name, 2, block) }
	a := newGroupConsumer(t, rdb, h, cfgOf("a", 5*time.Second))
	a.reading.Init()
	runConsumer(t, a)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return owns(rdb, a, 0) && owns(rdb, a, 1) },
		"a did not take both partitions")
	// a's worker of partition 1 is blocked in its read for 5 s from now.
	a.reading.Clear()
	if _, err := a.reading.WaitFor(10*time.Second, func(p int) bool { return p == 1 }); err != nil {
		t.Fatal(err)
	}
	b := newGroupConsumer(t, rdb, h, cfgOf("b", 100*time.Millisecond))
	started := time.Now()
	runConsumer(t, b)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return owns(rdb, b, 1) }, "b did not take partition 1")
	took := time.Since(started)
	t.Logf("b held the partition a handed over %s after it started", took.Round(time.Millisecond))
	if took > 1500*time.Millisecond {
		t.Errorf("the partition a handed over waited %s for b: its worker finished its read's block first", took.Round(time.Millisecond))
	}
	publishKeyed(t, rdb, b.parts[1].stream, "agg-1", keyOf(1, 2))
	outboxtest.Eventually(t, 10*time.Second, func() bool { return len(h.effects()) == 1 },
		"the event of the partition handed over was not applied")
	if !owns(rdb, b, 1) {
		t.Fatal("b lost partition 1")
	}
}

// partitioned is testConfig with n partitions and reads blocking block.
func partitioned(rdb outboxtest.Redis, name string, n int, block time.Duration) Config {
	cfg := testConfig(rdb, name)
	cfg.Partitions, cfg.Block = n, block
	return cfg
}

// keyOf is a partition key of partition p of n ("key-<i>", the first one).
func keyOf(p, n int) string {
	for i := 0; ; i++ {
		if k := fmt.Sprintf("key-%d", i); partition.Of(k, n) == p {
			return k
		}
	}
}

// runConsumer runs c until the test ends or the function it returns is
// called; either checks that Run returned no error.
func runConsumer(t *testing.T, c *Consumer) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	stop = func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("consumer %s: %v", c.cfg.Consumer, err)
		}
	}
	t.Cleanup(func() {
		select {
		case <-ctx.Done():
		default:
			stop()
		}
	})
	return stop
}

// A blocking read of any length ends about when asked, in whole slices and
// whatever is left: a leftover under a millisecond must not become BLOCK 0
// (Redis: forever; the client gives up only at its read deadline, 10 s
// on). The read before a pending retry is due blocks until then, to the
// nanosecond.
func TestBlockingReadOfAnyLengthEndsWhenAsked(t *testing.T) {
	t.Parallel()
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	stream := rdb.Prefix + "stream"
	if err := rdb.XGroupCreateMkStream(ctx, stream, "g", "0").Err(); err != nil {
		t.Fatal(err)
	}
	s := newStreams(rdb.Client, Config{Consumer: "c"}, slog.New(slog.DiscardHandler))
	for _, block := range []time.Duration{readSlice + 500*time.Microsecond, 300 * time.Microsecond, 2*readSlice + time.Nanosecond} {
		started := time.Now()
		res, err := s.xreadgroup(ctx, "g", []string{stream, ">"}, 1, block)
		took := time.Since(started)
		if err != nil || len(res) != 0 {
			t.Fatalf("read blocking %s: %v %v", block, res, err)
		}
		if took > block+time.Second {
			t.Errorf("a read asked to block %s took %s", block, took.Round(time.Millisecond))
		}
	}
}
