package outbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/testenv"
	"github.com/tedbank/outbox/ledger"
	"github.com/tedbank/outbox/relay/redisbroker"
)

// The relay warns about a Redis that would lose published events on restart
// or eviction, and is quiet about one configured for durability.
func TestRedisDurabilityCheck(t *testing.T) {
	for _, c := range []struct {
		args  []string
		warns []string
	}{
		{[]string{"--appendonly", "no", "--maxmemory-policy", "allkeys-lru"}, []string{"appendonly", "allkeys-lru"}},
		{[]string{"--appendonly", "yes", "--maxmemory-policy", "noeviction"}, nil},
	} {
		srv, err := testenv.LocalRedis(t.Context(), testenv.Options{ExtraArgs: c.args})
		if err != nil {
			t.Fatal(err)
		}
		opt, _ := redis.ParseURL(srv.URL)
		rdb := redis.NewClient(opt)
		got := redisbroker.CheckDurability(t.Context(), rdb)
		_ = rdb.Close()
		_ = srv.Close()
		if len(got) != len(c.warns) {
			t.Fatalf("%v: warnings %q, want %d", c.args, got, len(c.warns))
		}
		for i, w := range c.warns {
			if !strings.Contains(got[i], w) {
				t.Errorf("%v: warning %q does not mention %q", c.args, got[i], w)
			}
		}
	}
}

// A relay and the consumers (anti-fraud, the ledger: every consumer of
// package consumer) refuse to start on a Redis whose maxmemory-policy
// evicts (volatile-lru, the default of several managed services): its
// dedupe markers could be evicted and a redelivered TED judged twice. The
// policy is read from INFO, here on a Redis that forbids CONFIG, as managed
// services do. Allowed explicitly, both run (and the relay publishes).
func TestEvictingRedisIsRefused(t *testing.T) {
	srv := outboxtest.OwnRedis(t, "--maxmemory-policy", "volatile-lru", "--rename-command", "CONFIG", "")
	rdb := srv.Client
	if err := rdb.ConfigGet(t.Context(), "maxmemory-policy").Err(); err == nil {
		t.Fatal("CONFIG answers: the test's Redis is not like a managed one")
	}
	f := newFixture(t)
	refused := func(what string, err error, sentinel error) {
		t.Helper()
		if !errors.Is(err, sentinel) || !strings.Contains(err.Error(), "volatile-lru") ||
			!strings.Contains(err.Error(), "allow-evicting-redis") {
			t.Fatalf("%s on an evicting Redis: %v, want %v naming the policy and the override", what, err, sentinel)
		}
	}
	ctx, cancel := context.WithTimeout(f.Ctx, 20*time.Second)
	defer cancel()

	r := f.NewRelayOn(f.RelayConfig("relay"), f.RedisBroker(rdb, redisbroker.Config{}))
	refused("relay.Run", r.Run(ctx), redisbroker.ErrEvictingRedis)
	c, err := fraud.New(rdb, fraud.Config{Config: consumer.Config{Stream: f.Stream(), KeyPrefix: f.keyPrefix(), Consumer: "c1"}})
	if err != nil {
		t.Fatal(err)
	}
	refused("fraud Run", c.Run(ctx), consumer.ErrEvictingRedis)
	l, err := ledger.New(f.Pool, rdb, ledger.Config{Consumer: consumer.Config{Stream: f.Stream(), KeyPrefix: "ledger:", Consumer: "l1"}})
	if err != nil {
		t.Fatal(err)
	}
	refused("ledger Run", l.Run(ctx), consumer.ErrEvictingRedis)
	out, err := f.OutboxCmd("", "fraud", "--redis-url", srv.URL, "--stream", f.Stream(), "--key-prefix", f.keyPrefix()).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "volatile-lru") || !strings.Contains(string(out), "--allow-evicting-redis") {
		t.Fatalf("outbox fraud on an evicting Redis: %v\n%s", err, out)
	}

	// Allowed: they run, and the relay publishes.
	r = f.NewRelayOn(f.RelayConfig("relay"), f.RedisBroker(rdb, redisbroker.Config{AllowEvictingRedis: true}))
	f.Run(r.Run)
	c, err = fraud.New(rdb, fraud.Config{Config: consumer.Config{Stream: f.Stream(), KeyPrefix: f.keyPrefix(), Consumer: "c1", AllowEvictingRedis: true}})
	if err != nil {
		t.Fatal(err)
	}
	f.Run(c.Run)
	f.Settle(1)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		rep, err := fraud.ReadReport(f.Ctx, rdb, f.keys())
		return err == nil && rep.Verdicts == 1
	}, "the TED was not judged with the evicting Redis allowed")
}
