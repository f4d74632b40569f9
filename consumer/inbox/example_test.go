package inbox_test

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

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/consumer/inbox"
	"github.com/tedbank/outbox/relay/entry"
)

// Consume an event type of your own exactly once in your own PostgreSQL:
// the handler writes its effect through the transaction the inbox opens, and
// a redelivered event is skipped. Here order.placed events, published by a
// relay to outbox.event.order, add to a customer's total.
func Example() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	db, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL")) // your service's own database
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	opt, err := redis.ParseURL(os.Getenv("REDIS_URL"))
	if err != nil {
		log.Fatal(err)
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()

	// Your schema, and the inbox's (consumer_inbox, consumer_fences).
	if _, err := inbox.Migrate(ctx, db); err != nil {
		log.Fatal(err)
	}
	if _, err := db.Exec(ctx, `CREATE TABLE IF NOT EXISTS example_customer_totals (
		customer text PRIMARY KEY, total_cents bigint NOT NULL)`); err != nil {
		log.Fatal(err)
	}

	// The effect: decode the payload, write through tx. An error rolls the
	// transaction back (the event is retried); one wrapping
	// consumer.ErrInvalid says it never will apply (dead-lettered).
	handler := inbox.HandlerFunc(func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		var order struct {
			Customer   string `json:"customer"`
			TotalCents int64  `json:"total_cents"`
		}
		if err := json.Unmarshal(m.Payload, &order); err != nil || order.Customer == "" {
			return consumer.Invalid("order.placed payload %s: %v", m.Payload, err)
		}
		_, err := tx.Exec(ctx, `INSERT INTO example_customer_totals (customer, total_cents) VALUES ($1, $2)
			ON CONFLICT (customer) DO UPDATE SET total_cents = example_customer_totals.total_cents + excluded.total_cents`,
			order.Customer, order.TotalCents)
		return err
	})
	in, err := inbox.New(db, handler, inbox.Config{})
	if err != nil {
		log.Fatal(err)
	}
	stream := "example.inbox.outbox.event.order"
	c, err := consumer.New(rdb, in, consumer.Config{
		Name:      "billing", // metrics outbox_billing_*, group "billing"
		Stream:    stream,
		Consumer:  "billing-1", // stable across restarts, unique per process
		KeyPrefix: "example.inbox.billing:",
	})
	if err != nil {
		log.Fatal(err)
	}
	go func() { _ = c.Run(ctx) }()

	// One event, delivered twice (as after a relay crash between its XADD
	// and its mark), in the relay's wire format (relay/entry).
	eventID := uuid.NewString()
	for range 2 {
		rdb.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{
			entry.EventID, eventID, entry.EventType, "order.placed", entry.AggregateType, "order",
			entry.AggregateID, "o-1", entry.Payload, `{"customer": "ana", "total_cents": 990}`}})
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if st := c.Stats(); st.Processed == 1 && st.Duplicates == 1 {
			break
		}
		if time.Now().After(deadline) {
			log.Fatalf("the event was not applied once within 10s: %+v", c.Stats())
		}
	}
	var total int64
	if err := db.QueryRow(ctx, `SELECT total_cents FROM example_customer_totals WHERE customer = 'ana'`).Scan(&total); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("ana: %d cents (the duplicate delivery was skipped)\n", total)
	// Output:
	// ana: 990 cents (the duplicate delivery was skipped)
}
