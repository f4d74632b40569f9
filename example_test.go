package outbox_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox"
)

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
