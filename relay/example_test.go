package relay_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/relay/redisbroker"
)

// Run a relay: it publishes every committed outbox event to Redis Streams,
// one stream per aggregate type, until its context is cancelled (wire it to
// SIGTERM with signal.NotifyContext). NOTIFY wakes it within milliseconds of
// each commit; the fallback poll (Config.PollInterval) is only a safety net.
func ExampleRelay_Run() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	opt, err := redis.ParseURL(os.Getenv("REDIS_URL"))
	if err != nil {
		log.Fatal(err)
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()

	// Redis Streams (package natsbroker: NATS JetStream). The broker's own
	// Config trims the streams and can wait for replicas.
	b, err := redisbroker.New(rdb, redisbroker.Config{})
	if err != nil {
		log.Fatal(err)
	}
	r, err := relay.New(pool, b, relay.Config{
		Name:         "relay-1",                     // stable across restarts
		StreamPrefix: "example.relay.outbox.event.", // default outbox.event.
	})
	if err != nil {
		log.Fatal(err)
	}
	done := make(chan error)
	go func() { done <- r.Run(ctx) }()

	// An event committed with its business change (outbox.Write).
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := outbox.Write(ctx, tx, outbox.Message{
			AggregateType: "order", AggregateID: "o-42", EventType: "order.placed",
			Payload: []byte(`{"total_cents": 9990}`),
		})
		return err
	})
	if err != nil {
		log.Fatal(err)
	}
	for rdb.XLen(ctx, "example.relay.outbox.event.order").Val() == 0 {
		time.Sleep(time.Millisecond)
	}
	entry := rdb.XRange(ctx, "example.relay.outbox.event.order", "-", "+").Val()[0]
	fmt.Println(entry.Values["event_type"], entry.Values["aggregate_id"], entry.Values["partition_key"], entry.Values["payload"])
	cancel()
	fmt.Println("relay stopped:", <-done)
	// Output:
	// order.placed o-42 o-42 {"total_cents": 9990}
	// relay stopped: <nil>
}
