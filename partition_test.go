package outbox_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/tedbank/outbox"
)

// Every outbox row has a partition key: the one given, or the aggregate id
// (stored as NULL, read with coalesce), also for a plain INSERT of the four
// required columns. One longer than 200 bytes is refused by Write and by the
// database.
func TestPartitionKeyDefaultsToTheAggregateID(t *testing.T) {
	f := newFixture(t)
	msgs := []outbox.Message{
		{AggregateType: "account", AggregateID: "a-1", EventType: "account.credited", Payload: []byte(`{}`), PartitionKey: "customer-9"},
		{AggregateType: "account", AggregateID: "a-2", EventType: "account.credited", Payload: []byte(`{}`)},
	}
	var written []outbox.Written
	if err := pgx.BeginFunc(f.ctx, f.pool, func(tx pgx.Tx) (err error) {
		written, err = outbox.Write(f.ctx, tx, msgs...)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	f.exec(`INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload) VALUES ('account', 'a-3', 'account.opened', '{}')`)

	partition := func(where string, args ...any) string {
		t.Helper()
		var p string
		if err := f.pool.QueryRow(f.ctx, "SELECT coalesce(partition_key, aggregate_id) FROM outbox_messages WHERE "+where, args...).Scan(&p); err != nil {
			t.Fatal(err)
		}
		return p
	}
	if got := partition("id = $1", written[0].ID); got != "customer-9" {
		t.Errorf("given partition key: %q", got)
	}
	if got := partition("id = $1", written[1].ID); got != "a-2" {
		t.Errorf("default partition key: %q, want the aggregate id", got)
	}
	if got := partition("aggregate_id = 'a-3'"); got != "a-3" {
		t.Errorf("plain INSERT: partition key %q, want the aggregate id", got)
	}

	long := outbox.Message{AggregateType: "account", AggregateID: "a-4", EventType: "x", Payload: []byte(`{}`), PartitionKey: strings.Repeat("k", 201)}
	if err := long.Validate(); !errors.Is(err, outbox.ErrInvalidMessage) {
		t.Errorf("Validate of a 201-byte partition key: %v", err)
	}
	_, err := f.pool.Exec(f.ctx, `INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES ('account', 'a-4', 'x', '{}', $1)`, strings.Repeat("k", 201))
	if err == nil || !strings.Contains(err.Error(), "outbox_messages_partition_key_set") {
		t.Errorf("INSERT of a 201-byte partition key: %v, want the CHECK to refuse it", err)
	}
}
