package demo_test

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/tedbank/outbox/demo"
	"github.com/tedbank/outbox/internal/outboxtest"
)

// The demo's own checks pass against real servers, and it ends with its
// summary line.
func TestDemoChecksPass(t *testing.T) {
	pool := outboxtest.Postgres(t)
	rdb := outboxtest.NewRedis(t)
	var out bytes.Buffer
	err := demo.Run(context.Background(), demo.Config{
		Pool: pool, Redis: rdb.Client, DatabaseURL: pool.Config().ConnString(), RedisURL: rdb.URL,
		Binary: outboxtest.Binary(t), FailPoints: true, StreamPrefix: rdb.Prefix + "outbox.event.", KeyPrefix: rdb.Prefix + "fraud:",
		LedgerURL: outboxtest.PostgresURL(t), LedgerKeyPrefix: rdb.Prefix + "ledger:",
		Out: &out, Short: true,
	})
	t.Log("\n" + out.String())
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "checks passed, 0 failed") {
		t.Fatalf("no passing summary line")
	}
}
