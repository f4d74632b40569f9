package consumer

import (
	"context"
	"testing"
	"time"

	"github.com/tedbank/outbox/internal/outboxtest"
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
