package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/internal/consumertest"
	"github.com/tedbank/outbox/internal/relaytest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/testenv"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/relay/redisbroker"
	"github.com/tedbank/outbox/transfer"
)

// With MinReplicas, the relay marks published only what enough replicas
// confirmed: a primary that dies before its replica has the entries cannot
// lose an event PostgreSQL calls published. Unconfirmed entries are released
// without spending an attempt, and published once the replicas are there.
func TestRelayMarksPublishedOnlyWhatReplicasConfirmed(t *testing.T) {
	f := newFixture(t)
	rdb, addReplica := replicatedRedis(t)
	cfg := f.RelayConfig("r1")
	r := f.NewRelayOn(cfg, f.RedisBroker(rdb, redisbroker.Config{MinReplicas: 2, ReplicaTimeout: 100 * time.Millisecond}))
	teds := f.Settle(3)
	res, err := relaytest.DrainBatch(f.Ctx, r)
	if err != nil {
		t.Fatal(err)
	}
	if res.Published != 0 || res.Released != 3 || !res.BrokerDown {
		t.Fatalf("one replica of two: %+v, want the 3 entries released, none published", res)
	}
	var attempts, pending int
	if err := f.Pool.QueryRow(f.Ctx, "SELECT coalesce(sum(attempts), 0), count(*) FILTER (WHERE status = 'pending') FROM outbox_messages").Scan(&attempts, &pending); err != nil {
		t.Fatal(err)
	}
	if attempts != 0 || pending != 3 {
		t.Fatalf("after an unconfirmed publish: %d attempts spent, %d pending; want 0 and 3", attempts, pending)
	}

	addReplica() // the second replica arrives
	published := 0
	outboxtest.Eventually(t, 20*time.Second, func() bool {
		res, err := relaytest.DrainBatch(f.Ctx, r)
		if err != nil {
			t.Fatal(err)
		}
		published += res.Published
		return published == 3
	}, "not published once both replicas were there")
	for _, ted := range teds {
		var status string
		if err := f.Pool.QueryRow(f.Ctx, "SELECT status FROM outbox_messages WHERE aggregate_id = $1", ted.ID.String()).Scan(&status); err != nil || status != "published" {
			t.Fatalf("event of %s: %q (%v)", ted.ID, status, err)
		}
	}
	if n, err := rdb.XLen(f.Ctx, f.Stream()).Result(); err != nil || n < 6 {
		t.Fatalf("stream holds %d entries (%v): want the 3 unconfirmed ones and the 3 confirmed", n, err)
	}

	if _, err := redisbroker.New(rdb, redisbroker.Config{MinReplicas: -1}); err == nil {
		t.Fatal("negative MinReplicas accepted")
	}
	// A wait for the replicas as long as the relay's whole publish is refused.
	b := f.RedisBroker(rdb, redisbroker.Config{MinReplicas: 1, ReplicaTimeout: time.Second})
	cfg.PublishTimeout = time.Second
	if _, err := relay.New(f.Pool, b, cfg); !errors.Is(err, relay.ErrConfig) {
		t.Fatalf("a replica timeout as long as the publish timeout: %v, want ErrConfig", err)
	}
}

// replicatedRedis starts a Redis primary of the test's own with one replica,
// and returns a client of the primary and a function that adds a replica;
// each returns once every replica is in sync.
func replicatedRedis(t *testing.T) (*redis.Client, func()) {
	t.Helper()
	primary := ownRedis(t, "--repl-diskless-sync-delay", "0") // replicas sync at once
	host, port := hostPortOf(t, primary.URL)
	o, err := redis.ParseURL(primary.URL)
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(o)
	t.Cleanup(func() { _ = rdb.Close() })
	replicas := 0
	add := func() {
		t.Helper()
		ownRedis(t, "--replicaof", host, port)
		replicas++
		outboxtest.Eventually(t, 20*time.Second, func() bool {
			info, err := rdb.Info(context.Background(), "replication").Result()
			return err == nil && strings.Count(info, "state=online") == replicas
		}, "replica not in sync")
	}
	add()
	return rdb, add
}

// ownRedis starts a Redis server of the test's own from the local binary.
func ownRedis(t *testing.T, args ...string) *testenv.Server {
	t.Helper()
	s, err := testenv.LocalRedis(context.Background(), testenv.Options{ExtraArgs: args})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func hostPortOf(t *testing.T, raw string) (host, port string) {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	return u.Hostname(), u.Port()
}

// With MinReplicas, anti-fraud acknowledges an entry only once enough
// replicas have its effect; until then the entry stays pending, and its
// redelivery is recognised as a duplicate once they do.
func TestConsumerAcknowledgesOnlyWhatReplicasConfirmed(t *testing.T) {
	ctx := context.Background()
	rdb, addReplica := replicatedRedis(t)
	c, err := fraud.New(rdb, fraud.Config{Config: consumer.Config{Consumer: "c1"}, MinReplicas: 2, ReplicaTimeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.EnsureGroup(ctx); err != nil {
		t.Fatal(err)
	}
	ted := publishTED(t, rdb, fraud.DefaultStream)
	if _, err := consumertest.ReadNew(ctx, c.Consumer); err == nil {
		t.Fatal("effects confirmed by one replica of two: no error")
	}
	pending := func() int64 {
		p, err := rdb.XPending(ctx, fraud.DefaultStream, fraud.DefaultGroup).Result()
		if err != nil {
			t.Fatal(err)
		}
		return p.Count
	}
	if n := pending(); n != 1 {
		t.Fatalf("%d entries pending, want the unconfirmed one", n)
	}

	addReplica()
	outboxtest.Eventually(t, 20*time.Second, func() bool {
		_ = consumertest.ProcessPending(ctx, c.Consumer) // fails while the new replica catches up
		return pending() == 0
	}, "entry still pending once both replicas were there")
	rep, err := fraud.ReadReport(ctx, rdb, fraud.Keys{Prefix: fraud.DefaultKeyPrefix})
	if err != nil {
		t.Fatal(err)
	}
	if v, _ := fraud.Verdict(ctx, rdb, fraud.Keys{Prefix: fraud.DefaultKeyPrefix}, ted); rep.Verdicts != 1 || rep.DuplicatesSkipped < 1 || v != "approve" {
		t.Fatalf("report %+v, verdict %q: want the effect applied once and its redelivery skipped", rep, v)
	}
}

// publishTED adds one transfer.settled entry to stream, as the relay writes
// it, and returns its transfer id.
func publishTED(t *testing.T, rdb *redis.Client, stream string) string {
	t.Helper()
	id, tid := uuid.New(), uuid.New()
	now := time.Now().UTC()
	p, _ := json.Marshal(transfer.SettledEvent{SchemaVersion: transfer.SchemaVersion, EventID: id, TransferID: tid,
		FromAccount: "ana", ToAccount: "bia", AmountCents: 100, Currency: "BRL", SettledAt: now})
	err := rdb.XAdd(context.Background(), &redis.XAddArgs{Stream: stream, Values: []any{
		"event_id", id.String(), "event_type", transfer.EventSettled, "aggregate_type", "transfer",
		"aggregate_id", tid.String(), "payload", string(p), "headers", "{}", "occurred_at", now.Format(time.RFC3339Nano),
	}}).Err()
	if err != nil {
		t.Fatal(err)
	}
	return tid.String()
}
