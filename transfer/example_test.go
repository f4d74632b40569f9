package transfer_test

import (
	"context"
	"fmt"
	"log"
	"os"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/transfer"
)

// Settle a TED: the transfer and its transfer.settled event are committed in
// one transaction. Settling the same id again writes nothing; bad input
// writes nothing and says why.
func ExampleSettle() {
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
