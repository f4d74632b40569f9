package outbox_test

import (
	"context"
	"github.com/tedbank/outbox/internal/relaytest"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/admin"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/transfer"
)

// asRole returns a pool to the fixture's database logged in as a fresh login
// role that is a member of role (roles are cluster-wide: unique names,
// dropped after the test).
func (f *fixture) asRole(role string) *pgxpool.Pool {
	f.T.Helper()
	login := "t_" + strings.ReplaceAll(uuid.NewString()[:12], "-", "")
	ctx := context.Background()
	if _, err := f.Pool.Exec(ctx, "CREATE ROLE "+login+" LOGIN PASSWORD 'pw' IN ROLE "+role); err != nil {
		f.T.Fatal(err)
	}
	u, err := url.Parse(f.DBURL)
	if err != nil {
		f.T.Fatal(err)
	}
	u.User = url.UserPassword(login, "pw")
	pool, err := pgxpool.New(ctx, u.String())
	if err != nil {
		f.T.Fatal(err)
	}
	f.T.Cleanup(func() {
		pool.Close()
		_, _ = f.Pool.Exec(context.Background(), "DROP ROLE IF EXISTS "+login)
	})
	return pool
}

// withRoles runs sql/roles.sql on the fixture's database and returns pools
// logged in as an outbox_writer and as an outbox_relay.
func (f *fixture) withRoles() (writer, relay *pgxpool.Pool) {
	f.T.Helper()
	roles, err := os.ReadFile("sql/roles.sql")
	if err != nil {
		f.T.Fatal(err)
	}
	if _, err := f.Pool.Exec(f.Ctx, string(roles)); err != nil {
		f.T.Fatalf("sql/roles.sql: %v", err)
	}
	return f.asRole("outbox_writer"), f.asRole("outbox_relay")
}

// The relay and settle work under the least-privilege roles of
// sql/roles.sql, and each role is refused what it must not do.
func TestLeastPrivilegeRoles(t *testing.T) {
	f := newFixture(t)
	writer, relayPool := f.withRoles()

	teds := make([]transfer.Transfer, 5)
	for i := range teds {
		teds[i] = transfer.Transfer{ID: uuid.New(), FromAccount: "a", ToAccount: "b", AmountCents: int64(i + 1)}
		if _, err := transfer.Settle(f.Ctx, writer, teds[i]); err != nil {
			t.Fatalf("settle as outbox_writer: %v", err)
		}
	}
	if res, err := transfer.Settle(f.Ctx, writer, teds[0]); err != nil || !res.AlreadySettled {
		t.Fatalf("idempotent settle as outbox_writer: %+v %v", res, err)
	}

	cfg := f.RelayConfig("r1")
	cfg.ListenConfig = relayPool.Config().ConnConfig.Copy()
	r := f.NewRelayWithPool(relayPool, cfg)
	f.Run(r.Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 5
	}, "relay under outbox_relay did not publish")
	if n, err := relaytest.Reap(f.Ctx, r); err != nil || n != 0 {
		t.Fatalf("reap as outbox_relay: %d %v", n, err)
	}

	for _, c := range []struct {
		who  string
		pool *pgxpool.Pool
		sql  string
	}{
		{"writer", writer, "UPDATE outbox_messages SET status = 'published'"},
		{"writer", writer, "DELETE FROM outbox_messages"},
		{"writer", writer, "DELETE FROM transfers"},
		{"relay", relayPool, "INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload) VALUES ('x', 'y', 'z', '{}')"},
		{"relay", relayPool, "DELETE FROM outbox_messages"},
		{"relay", relayPool, "SELECT count(*) FROM transfers"},
		// Column by column: the writer inserts an event's own
		// columns only, never its delivery state or its place in the order;
		// the relay changes the delivery columns only, never what was
		// committed.
		{"writer", writer, "INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, status, published_at) VALUES ('x', 'y', 'z', '{}', 'published', now())"},
		{"writer", writer, "INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, seq) VALUES ('x', 'y', 'z', '{}', 1)"},
		{"writer", writer, "INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, attempts) VALUES ('x', 'y', 'z', '{}', 9)"},
		{"writer", writer, "INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, first_sent_at) VALUES ('x', 'y', 'z', '{}', now() - interval '1 day')"},
		{"writer", writer, "INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, next_attempt_at) VALUES ('x', 'y', 'z', '{}', now() + interval '1 day')"},
		{"writer", writer, "INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, created_at) VALUES ('x', 'y', 'z', '{}', now())"},
		{"writer", writer, "INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, payload_bytes) VALUES ('x', 'y', 'z', '{}', 1)"},
		{"relay", relayPool, "UPDATE outbox_messages SET payload = '{\"amount_cents\": 1}'"},
		{"relay", relayPool, "UPDATE outbox_messages SET partition_key = 'other'"},
		{"relay", relayPool, "UPDATE outbox_messages SET aggregate_id = 'other'"},
		{"relay", relayPool, "UPDATE outbox_messages SET event_type = 'other'"},
		{"relay", relayPool, "UPDATE outbox_messages SET headers = '{}'"},
		{"relay", relayPool, "UPDATE outbox_messages SET seq = seq + 1000"},
	} {
		if _, err := c.pool.Exec(f.Ctx, c.sql); err == nil || !strings.Contains(err.Error(), "permission denied") {
			t.Errorf("%s ran %q: err %v, want permission denied", c.who, c.sql, err)
		}
	}
	// What they may do, they can: a plain SQL writer's event (keyed by the
	// trigger of migration 0015 under the writer's rights), and the
	// operators' requeue and repair as outbox_admin.
	if _, err := writer.Exec(f.Ctx, `INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, headers, partition_key)
		VALUES ('order', 'o-1', 'order.placed', '{}', '{}', 'c-1'), ('transfer', 't-1', 'transfer.settled', '{"from_account": "a"}', '{}', NULL)`); err != nil {
		t.Fatalf("a plain SQL writer's insert as outbox_writer: %v", err)
	}
	adminPool := f.asRole("outbox_admin")
	var id uuid.UUID
	if err := f.Pool.QueryRow(f.Ctx, "SELECT id FROM outbox_messages WHERE status = 'published' LIMIT 1").Scan(&id); err != nil {
		t.Fatal(err)
	}
	if res, err := admin.Republish(f.Ctx, adminPool, []uuid.UUID{id}, "ops", "test"); err != nil || len(res.Republished) != 1 {
		t.Fatalf("republish as outbox_admin: %+v %v", res, err)
	}
}
