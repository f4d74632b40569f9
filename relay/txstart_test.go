package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/tedbank/outbox/internal/queries"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/transfer"
)

// A relay's round trip is a READ COMMITTED transaction: its read sees the
// rows committed before the read began, including those of writers that
// began after the transaction did (while the relay said "sleep" and waited
// for the writers that saw it busy, for one). Such a row must be read like
// any other. Defect (found by make chaos, partitions, seed
// 1796567561827720980): the reads took only rows with next_attempt_at <=
// now(), the relay transaction's start, and a fresh row's next_attempt_at
// is its writer's start: the row was skipped. A partition owner then
// published the next event of its key first (its read's per-key check
// waits only for rows with a failed attempt), and a row claimer that went
// to sleep after that read left it for the poll.
func TestReadsTakeRowsOfWritersThatBeganAfterTheRelayTransaction(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := f.Ctx
	const sender = "acct-late"
	settleIn := func(tx pgx.Tx) uuid.UUID {
		t.Helper()
		res, err := transfer.SettleTx(ctx, tx, transfer.Transfer{ID: uuid.New(), FromAccount: sender, ToAccount: "b", AmountCents: 1})
		if err != nil {
			t.Fatal(err)
		}
		return res.EventID
	}
	begin := func() pgx.Tx {
		t.Helper()
		tx, err := f.Pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
		if _, err := tx.Exec(ctx, "SELECT now()"); err != nil { // the transaction's start
			t.Fatal(err)
		}
		time.Sleep(5 * time.Millisecond) // the next one's start is later
		return tx
	}

	for _, c := range []struct {
		name string
		read func(tx pgx.Tx) ([]uuid.UUID, error)
	}{
		{"partition read", func(tx pgx.Tx) ([]uuid.UUID, error) {
			st := queries.RelayRead(100, 16, []int32{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, nil,
				relay.Config{}.RedeliveryWindow().Milliseconds(), 1<<20)
			return ids(ctx, tx, st)
		}},
		{"row claim", func(tx pgx.Tx) ([]uuid.UUID, error) {
			st := queries.RelayClaim(100, uuid.New(), "r", relay.Config{}.RedeliveryWindow().Milliseconds(), 0, 1<<20)
			return ids(ctx, tx, st)
		}},
	} {
		f.Exec("DELETE FROM outbox_messages")
		// Writer A begins, then the relay's transaction, then writer B;
		// B writes the sender's first event and commits, then A its second.
		a := begin()
		relayTx := begin()
		b := begin()
		first := settleIn(b)
		if err := b.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		second := settleIn(a)
		if err := a.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		got, err := c.read(relayTx)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if len(got) != 1 || got[0] != first {
			t.Fatalf("%s: read %v, want the sender's first event %s alone (its second is %s)", c.name, got, first, second)
		}
		_ = relayTx.Rollback(ctx)
	}
}

// ids runs st in tx and returns the first column of each row: the event ids.
func ids(ctx context.Context, tx pgx.Tx, st queries.Statement) ([]uuid.UUID, error) {
	rows, err := tx.Query(ctx, st.SQL, st.Args...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (uuid.UUID, error) {
		vals, err := row.Values()
		if err != nil {
			return uuid.UUID{}, err
		}
		return vals[0].([16]byte), nil // pgx's value of a uuid column
	})
}
