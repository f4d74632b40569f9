package outbox_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox"
	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/transfer"
)

// Settle a TED: the transfer and its transfer.settled event are committed in
// one transaction. Settling the same id again writes nothing.
func Example_settle() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	ted := transfer.Transfer{ID: uuid.New(), FromAccount: "0001-12345", ToAccount: "0002-67890", AmountCents: 150_000}
	res, err := transfer.Settle(ctx, pool, ted)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("event written:", res.EventID != uuid.Nil)

	again, err := transfer.Settle(ctx, pool, ted)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("second settle wrote nothing:", again.AlreadySettled)

	_, err = transfer.Settle(ctx, pool, transfer.Transfer{ID: uuid.New(), FromAccount: "a", ToAccount: "b", AmountCents: -1})
	fmt.Println(err)
	// Output:
	// event written: true
	// second settle wrote nothing: true
	// invalid transfer: amount_cents must be positive
}

// Write your own event in your own transaction, next to your own change.
func ExampleWrite() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	payload, _ := json.Marshal(map[string]any{"order_id": "o-42", "total_cents": 9_990})
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		// ... your business change, in tx ...
		written, err := outbox.Write(ctx, tx, outbox.Message{
			AggregateType: "example_order", // published to outbox.event.example_order
			AggregateID:   "o-42",
			EventType:     "order.placed",
			Payload:       payload,
		})
		if err != nil {
			return err
		}
		fmt.Println("events written:", len(written))
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
	// Output:
	// events written: 1
}

// Run a relay: it publishes every committed outbox event to Redis Streams
// until its context is cancelled (wire it to SIGTERM with signal.NotifyContext).
func Example_relay() {
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

	r, err := relay.New(pool, rdb, relay.Config{
		Name:         "relay-1",
		StreamPrefix: "example.outbox.event.", // default outbox.event.
	})
	if err != nil {
		log.Fatal(err)
	}
	done := make(chan error)
	go func() { done <- r.Run(ctx) }()

	ted := transfer.Transfer{ID: uuid.New(), FromAccount: "0003-11111", ToAccount: "0004-22222", AmountCents: 42_00}
	if _, err := transfer.Settle(ctx, pool, ted); err != nil {
		log.Fatal(err)
	}
	for rdb.XLen(ctx, "example.outbox.event.transfer").Val() == 0 {
		time.Sleep(time.Millisecond) // NOTIFY wakes the relay within milliseconds
	}
	cancel()
	fmt.Println("relay stopped:", <-done)
	// Output:
	// relay stopped: <nil>
}

// Run the anti-fraud consumer on the stream a relay with StreamPrefix
// "example.outbox.event." publishes transfer events to: it applies each
// transfer.settled event once, however often it is delivered. This is
// anti-fraud's own consumer; for events of your own, read with a consumer
// group as fraud/consumer.go does and make your effect idempotent on
// event_id.
func Example_consumer() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	opt, err := redis.ParseURL(os.Getenv("REDIS_URL"))
	if err != nil {
		log.Fatal(err)
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()

	stream := "example.outbox.event.transfer" // <StreamPrefix><aggregate_type>, as Example_relay publishes
	c, err := fraud.New(rdb, fraud.Config{
		Stream:    stream,
		Consumer:  "fraud-1", // stable across restarts
		KeyPrefix: "example.fraud:",
	})
	if err != nil {
		log.Fatal(err)
	}
	go func() { _ = c.Run(ctx) }()

	// One event, delivered twice (as after a relay crash).
	eventID, transferID := uuid.New(), uuid.New()
	payload, _ := json.Marshal(transfer.SettledEvent{
		SchemaVersion: 1, EventID: eventID, TransferID: transferID, FromAccount: "0005-33333",
		ToAccount: "0006-44444", AmountCents: 10_000, Currency: "BRL", SettledAt: time.Now().UTC(),
	})
	for range 2 {
		rdb.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{
			"event_id", eventID.String(), "event_type", transfer.EventSettled, "payload", string(payload)}})
	}
	// The stream may also hold what Example_relay published: look at this
	// sender only.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		rep, err := fraud.ReadReport(ctx, rdb, fraud.Keys{Prefix: "example.fraud:"})
		if err != nil {
			log.Fatal(err)
		}
		if acct := rep.Accounts["0005-33333"]; acct.Transfers == 1 && rep.DuplicatesSkipped == 1 {
			fmt.Printf("0005-33333: %d transfer, %d cents; duplicates skipped %d\n",
				acct.Transfers, acct.SentCents, rep.DuplicatesSkipped)
			break
		}
		if time.Now().After(deadline) {
			log.Fatalf("the event was not applied once within 10s: %+v", rep)
		}
	}
	// Output:
	// 0005-33333: 1 transfer, 10000 cents; duplicates skipped 1
}
