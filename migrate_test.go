package outbox_test

import (
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/tedbank/outbox"
)

// A service migrates from its own code: on an empty schema Migrate applies
// every migration (the ones Migrations lists, in order) and the outbox works;
// a second run applies nothing.
func TestMigrateFromServiceCode(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.Exec(`DROP SCHEMA public CASCADE; CREATE SCHEMA public`)

	all, err := outbox.Migrations()
	if err != nil || len(all) == 0 {
		t.Fatalf("Migrations() = %d migrations, %v", len(all), err)
	}
	for i, m := range all {
		if m.Version != i+1 || m.Name == "" || m.SQL == "" {
			t.Fatalf("migration %d = %d %q (%d bytes of SQL), want version %d with a name and SQL", i, m.Version, m.Name, len(m.SQL), i+1)
		}
	}
	applied, err := outbox.Migrate(f.Ctx, f.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if len(applied) != len(all) || applied[len(applied)-1] != all[len(all)-1] {
		t.Fatalf("applied %d migrations, want all %d", len(applied), len(all))
	}
	err = pgx.BeginFunc(f.Ctx, f.Pool, func(tx pgx.Tx) error {
		_, err := outbox.Write(f.Ctx, tx, outbox.Message{AggregateType: "order", AggregateID: "o-1", EventType: "order.placed", Payload: []byte(`{}`)})
		return err
	})
	if err != nil {
		t.Fatalf("write after Migrate: %v", err)
	}
	if again, err := outbox.Migrate(f.Ctx, f.Pool); err != nil || len(again) != 0 {
		t.Fatalf("second Migrate applied %d, %v; want none", len(again), err)
	}
}
