package testenv

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/redis/go-redis/v9"
)

// A local Redis Cluster: three masters that split the slots, three
// replicas, keys spread over the masters, a hash tag keeping keys in one
// slot, and a master's writes reaching its replica.
//
// Not parallel: its six servers take free ports while the restart tests
// (parallel) count on getting their stopped server's port back.
func TestLocalRedisCluster(t *testing.T) {
	ctx := t.Context()
	c, err := LocalRedisCluster(ctx, testOptions(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	if len(c.Nodes) != 6 || !strings.HasPrefix(c.URL, "redis://127.0.0.1:") || strings.Count(c.URL, "addr=") != 5 {
		t.Fatalf("cluster %d nodes, URL %q", len(c.Nodes), c.URL)
	}
	rdb, err := c.Client()
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()

	for i := range 100 {
		if err := rdb.Set(ctx, fmt.Sprintf("k%d", i), i, 0).Err(); err != nil {
			t.Fatalf("SET k%d: %v", i, err)
		}
	}
	var masters, withKeys atomic.Int32
	err = rdb.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error {
		masters.Add(1)
		n, err := m.DBSize(ctx).Result()
		if n > 0 {
			withKeys.Add(1)
		}
		return err
	})
	if err != nil || masters.Load() != 3 || withKeys.Load() != 3 {
		t.Fatalf("masters %d, with keys %d, err %v: want the 100 keys spread over 3 masters", masters.Load(), withKeys.Load(), err)
	}
	// A hash tag keeps keys in one slot: a multi-key command works.
	if err := rdb.MSet(ctx, "{p3}:stream", "a", "{p3}:state", "b").Err(); err != nil {
		t.Fatalf("MSET with one hash tag: %v", err)
	}
	if err := rdb.MSet(ctx, "x:stream", "a", "y:state", "b").Err(); err == nil || !strings.Contains(err.Error(), "CROSSSLOT") {
		t.Fatalf("MSET across slots: %v, want CROSSSLOT", err)
	}
	// Writes reach the replicas: SET then WAIT 1 on the key's master, on
	// one connection (WAIT counts that connection's writes).
	m, err := rdb.MasterForKey(ctx, "w")
	if err != nil {
		t.Fatal(err)
	}
	var wait *redis.Cmd
	if _, err := m.Pipelined(ctx, func(p redis.Pipeliner) error {
		p.Set(ctx, "w", 1, 0)
		wait = p.Do(ctx, "WAIT", 1, 2000)
		return nil
	}); err != nil {
		t.Fatalf("SET + WAIT 1 on %s: %v", m.Options().Addr, err)
	}
	if n, err := wait.Int(); err != nil || n < 1 {
		t.Fatalf("WAIT 1 on %s: %d replicas acknowledged, %v", m.Options().Addr, n, err)
	}
}
