// Command billing is the README's own consumer ("Your own consumer, exactly once in your own
// PostgreSQL"): it keeps customer_totals from order.placed events, each applied once through
// consumer/inbox. Copy it into cmd/billing/main.go to make it yours.
package main

import (
	"context"
	"encoding/json"
	"log"
	"os"
	"os/signal"
	"syscall"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/consumer/inbox"
)

// placed applies one order.placed event; every write goes through tx.
func placed(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
	var order struct {
		Customer   string `json:"customer"`
		TotalCents int64  `json:"total_cents"`
	}
	if err := json.Unmarshal(m.Payload, &order); err != nil || order.Customer == "" {
		return consumer.Invalid("payload %s: %v", m.Payload, err) // never applies: dead-lettered
	}
	_, err := tx.Exec(ctx, `INSERT INTO customer_totals (customer, total_cents) VALUES ($1, $2)
		ON CONFLICT (customer) DO UPDATE SET total_cents = customer_totals.total_cents + excluded.total_cents`,
		order.Customer, order.TotalCents)
	return err // an error rolls back: retried with backoff
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	db, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
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
	if _, err := inbox.Migrate(ctx, db); err != nil { // consumer_inbox, consumer_fences
		log.Fatal(err)
	}
	if _, err := db.Exec(ctx, `CREATE TABLE IF NOT EXISTS customer_totals (
		customer text PRIMARY KEY, total_cents bigint NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	in, err := inbox.New(db, inbox.HandlerFunc(placed), inbox.Config{})
	if err != nil {
		log.Fatal(err)
	}
	c, err := consumer.New(rdb, in, consumer.Config{
		Name:     "billing",            // group "billing", metrics outbox_billing_*
		Stream:   "outbox.event.order", // the relay's stream for aggregate_type 'order'
		Consumer: "billing-1",          // stable across restarts, unique per running process
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := c.Run(ctx); err != nil { // until SIGINT/SIGTERM
		log.Fatal(err)
	}
}
