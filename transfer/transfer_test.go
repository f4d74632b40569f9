package transfer_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/transfer"
	"github.com/tedbank/outbox/transfer/settled"
)

func counts(t *testing.T, pool *pgxpool.Pool, id uuid.UUID) (transfers, events int) {
	t.Helper()
	err := pool.QueryRow(context.Background(), `SELECT
		(SELECT count(*) FROM transfers WHERE id = $1),
		(SELECT count(*) FROM outbox_messages WHERE aggregate_id = $1::text)`, id).Scan(&transfers, &events)
	if err != nil {
		t.Fatal(err)
	}
	return transfers, events
}

func valid() transfer.Transfer {
	return transfer.Transfer{ID: uuid.New(), FromAccount: "acct-a", ToAccount: "acct-b", AmountCents: 12_345}
}

func TestSettleWritesTransferAndEventTogether(t *testing.T) {
	pool := outboxtest.Postgres(t)
	ctx := context.Background()
	tr := valid()
	res, err := transfer.Settle(ctx, pool, tr)
	if err != nil {
		t.Fatal(err)
	}
	if res.AlreadySettled || res.EventID == uuid.Nil {
		t.Fatalf("result %+v: want a new event", res)
	}
	if n, e := counts(t, pool, tr.ID); n != 1 || e != 1 {
		t.Fatalf("transfers=%d events=%d, want 1 and 1", n, e)
	}

	var (
		id                         uuid.UUID
		aggType, eventType, status string
		payload, headers           []byte
	)
	err = pool.QueryRow(ctx, `SELECT id, aggregate_type, event_type, status, payload, headers
		FROM outbox_messages WHERE aggregate_id = $1`, tr.ID.String()).
		Scan(&id, &aggType, &eventType, &status, &payload, &headers)
	if err != nil {
		t.Fatal(err)
	}
	if id != res.EventID || aggType != "transfer" || eventType != "transfer.settled" || status != "pending" {
		t.Fatalf("row id=%s type=%s/%s status=%s", id, aggType, eventType, status)
	}
	// One sender's TEDs share a partition key, so they stay in settled order.
	var partition string
	if err := pool.QueryRow(ctx, `SELECT partition_key FROM outbox_messages WHERE id = $1`, id).Scan(&partition); err != nil {
		t.Fatal(err)
	}
	if partition != tr.FromAccount {
		t.Fatalf("partition key %q, want the sender %q", partition, tr.FromAccount)
	}
	var ev transfer.SettledEvent
	if err := json.Unmarshal(payload, &ev); err != nil {
		t.Fatal(err)
	}
	if ev.EventID != res.EventID || ev.TransferID != tr.ID || ev.FromAccount != "acct-a" || ev.ToAccount != "acct-b" ||
		ev.AmountCents != 12_345 || ev.Currency != "BRL" || ev.SchemaVersion != 1 || !ev.SettledAt.Equal(res.SettledAt) {
		t.Fatalf("payload %+v does not describe %+v / %+v", ev, tr, res)
	}
}

func TestRolledBackTransactionLeavesNothing(t *testing.T) {
	pool := outboxtest.Postgres(t)
	ctx := context.Background()
	tr := valid()
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := transfer.SettleTx(ctx, tx, tr); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, "SELECT 1/0") // the caller's next step fails
		return err
	})
	if err == nil {
		t.Fatal("transaction should have failed")
	}
	if n, e := counts(t, pool, tr.ID); n != 0 || e != 0 {
		t.Fatalf("after rollback: transfers=%d events=%d, want 0 and 0", n, e)
	}
}

func TestFailedEventWriteRollsBackTheTransfer(t *testing.T) {
	pool := outboxtest.Postgres(t)
	ctx := context.Background()
	// Make every outbox insert fail inside the database.
	_, err := pool.Exec(ctx, `
		CREATE FUNCTION fail_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'outbox unavailable'; END $$;
		CREATE TRIGGER fail_outbox BEFORE INSERT ON outbox_messages
			FOR EACH ROW EXECUTE FUNCTION fail_outbox();`)
	if err != nil {
		t.Fatal(err)
	}
	tr := valid()
	if _, err := transfer.Settle(ctx, pool, tr); err == nil {
		t.Fatal("Settle succeeded although the event could not be written")
	}
	if n, e := counts(t, pool, tr.ID); n != 0 || e != 0 {
		t.Fatalf("transfers=%d events=%d, want neither", n, e)
	}
}

func TestSettleTwiceWritesOneEvent(t *testing.T) {
	pool := outboxtest.Postgres(t)
	ctx := context.Background()
	tr := valid()
	first, err := transfer.Settle(ctx, pool, tr)
	if err != nil {
		t.Fatal(err)
	}
	again, err := transfer.Settle(ctx, pool, tr)
	if err != nil {
		t.Fatal(err)
	}
	if !again.AlreadySettled || again.EventID != uuid.Nil || !again.SettledAt.Equal(first.SettledAt) {
		t.Fatalf("second settle: %+v, want AlreadySettled with the first settled_at", again)
	}
	if n, e := counts(t, pool, tr.ID); n != 1 || e != 1 {
		t.Fatalf("transfers=%d events=%d, want 1 and 1", n, e)
	}

	other := tr
	other.AmountCents++
	if _, err := transfer.Settle(ctx, pool, other); !errors.Is(err, transfer.ErrConflict) {
		t.Fatalf("same id, other amount: err=%v, want ErrConflict", err)
	}
	if n, e := counts(t, pool, tr.ID); n != 1 || e != 1 {
		t.Fatalf("after conflict: transfers=%d events=%d, want 1 and 1", n, e)
	}
}

func TestBadInputIsRefusedAndWritesNothing(t *testing.T) {
	pool := outboxtest.Postgres(t)
	ctx := context.Background()
	cases := map[string]func(*transfer.Transfer){
		"zero amount":       func(t *transfer.Transfer) { t.AmountCents = 0 },
		"negative amount":   func(t *transfer.Transfer) { t.AmountCents = -5 },
		"amount over max":   func(t *transfer.Transfer) { t.AmountCents = settled.MaxAmountCents + 1 },
		"empty from":        func(t *transfer.Transfer) { t.FromAccount = "" },
		"blank to":          func(t *transfer.Transfer) { t.ToAccount = "   " },
		"same accounts":     func(t *transfer.Transfer) { t.ToAccount = t.FromAccount },
		"unknown currency":  func(t *transfer.Transfer) { t.Currency = "XYZ" },
		"lowercase code":    func(t *transfer.Transfer) { t.Currency = "brl" },
		"no id":             func(t *transfer.Transfer) { t.ID = uuid.Nil },
		"padded account":    func(t *transfer.Transfer) { t.FromAccount = " acct-a" },
		"very long account": func(t *transfer.Transfer) { t.ToAccount = string(make([]byte, 65)) },
	}
	for name, mutate := range cases {
		t.Run(name, func(t *testing.T) {
			tr := valid()
			mutate(&tr)
			_, err := transfer.Settle(ctx, pool, tr)
			var verr *transfer.ValidationError
			if !errors.As(err, &verr) || !errors.Is(err, transfer.ErrInvalid) {
				t.Fatalf("err = %v, want a *ValidationError", err)
			}
		})
	}
	var n int
	if err := pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM transfers) + (SELECT count(*) FROM outbox_messages)").Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("%d rows written for bad input", n)
	}
}

func TestDatabaseRejectsImpossibleTransfers(t *testing.T) {
	pool := outboxtest.Postgres(t)
	ctx := context.Background()
	for name, q := range map[string]string{
		"amount":   `INSERT INTO transfers VALUES (gen_random_uuid(), 'a', 'b', 0, 'BRL')`,
		"same":     `INSERT INTO transfers VALUES (gen_random_uuid(), 'a', 'a', 10, 'BRL')`,
		"empty":    `INSERT INTO transfers VALUES (gen_random_uuid(), '', 'b', 10, 'BRL')`,
		"currency": `INSERT INTO transfers VALUES (gen_random_uuid(), 'a', 'b', 10, 'reais')`,
	} {
		if _, err := pool.Exec(ctx, q); err == nil {
			t.Errorf("%s: the CHECK constraints accepted %s", name, q)
		}
	}
}

func TestFormatBRL(t *testing.T) {
	for cents, want := range map[int64]string{0: "0,00", 5: "0,05", 123456789: "1.234.567,89", 100000: "1.000,00", -250: "-2,50"} {
		if got := transfer.FormatBRL(cents); got != want {
			t.Errorf("FormatBRL(%d) = %q, want %q", cents, got, want)
		}
	}
}
