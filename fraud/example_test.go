package fraud_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/relay/entry"
	"github.com/tedbank/outbox/transfer/settled"
)

// Run the anti-fraud consumer on the stream a relay publishes transfer
// events to (<StreamPrefix>transfer): it applies each transfer.settled event
// once, however often it is delivered. For events of your own, read with a
// consumer group as this package does and make your effect idempotent on
// event_id.
func ExampleConsumer_Run() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	opt, err := redis.ParseURL(os.Getenv("REDIS_URL"))
	if err != nil {
		log.Fatal(err)
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()

	stream := "example.fraud.outbox.event.transfer"
	c, err := fraud.New(rdb, fraud.Config{
		Config: consumer.Config{ // the consumer group's settings
			Stream:    stream,
			Consumer:  "fraud-1", // stable across restarts
			KeyPrefix: "example.fraud.",
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	go func() { _ = c.Run(ctx) }()

	// One event, delivered twice (as after a relay crash between its XADD
	// and its mark), in the relay's wire format (relay/entry).
	eventID := uuid.New()
	payload, _ := json.Marshal(settled.Payload{
		SchemaVersion: settled.Version, EventID: eventID, TransferID: uuid.New(), FromAccount: "0005-33333",
		ToAccount: "0006-44444", AmountCents: 10_000, Currency: "BRL", SettledAt: time.Now().UTC(),
	})
	for range 2 {
		rdb.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{
			entry.EventID, eventID.String(), entry.EventType, settled.Type, entry.Payload, string(payload)}})
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		rep, err := fraud.ReadReport(ctx, rdb, fraud.Keys{Prefix: "example.fraud."})
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
