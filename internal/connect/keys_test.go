package connect_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/tedbank/outbox/internal/connect"
	"github.com/tedbank/outbox/internal/outboxtest"
)

func TestMain(m *testing.M) { outboxtest.Main(m) }

// DeleteKeys deletes every key of its pattern, past one pipeline's
// thousand, and no other.
func TestDeleteKeysDeletesThePatternOnly(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	pipe := rdb.Pipeline()
	for i := range 2500 {
		pipe.Set(ctx, fmt.Sprintf("%sgone:%d", rdb.Prefix, i), "x", 0)
	}
	pipe.Set(ctx, rdb.Prefix+"kept", "x", 0)
	if _, err := pipe.Exec(ctx); err != nil {
		t.Fatal(err)
	}
	if err := connect.DeleteKeys(ctx, rdb.Client, rdb.Prefix+"gone:*"); err != nil {
		t.Fatal(err)
	}
	if left, err := connect.Keys(ctx, rdb.Client, rdb.Prefix+"gone:*"); err != nil || len(left) != 0 {
		t.Fatalf("%d keys of the pattern left (%v), want none", len(left), err)
	}
	if n, err := rdb.Exists(ctx, rdb.Prefix+"kept").Result(); err != nil || n != 1 {
		t.Fatalf("a key outside the pattern: exists %d (%v), want kept", n, err)
	}
}
