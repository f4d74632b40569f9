package migrate_test

import (
	"context"
	"errors"
	"io/fs"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/internal/migrate"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/queries"
)

func TestUpIsIdempotentAndSafeConcurrently(t *testing.T) {
	// Start from an empty database and race four runs.
	url := outboxtest.PostgresURL(t)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `DROP SCHEMA public CASCADE; CREATE SCHEMA public`); err != nil {
		t.Fatal(err)
	}

	all, err := migrate.All()
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	results := make([]migrate.Result, 4)
	errs := make([]error, 4)
	for i := range results {
		wg.Go(func() { results[i], errs[i] = migrate.Up(ctx, pool) })
	}
	wg.Wait()
	applied := 0
	for i := range results {
		if errs[i] != nil {
			t.Fatalf("concurrent run %d: %v", i, errs[i])
		}
		if results[i].Current != all[len(all)-1].Version {
			t.Fatalf("run %d ended at version %d", i, results[i].Current)
		}
		applied += len(results[i].Applied)
	}
	if applied != len(all) {
		t.Fatalf("%d migrations applied across concurrent runs, want each once (%d)", applied, len(all))
	}
	again, err := migrate.Up(ctx, pool)
	if err != nil || len(again.Applied) != 0 {
		t.Fatalf("second run: %+v, %v; want nothing applied", again, err)
	}
	var recorded int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox_schema_migrations").Scan(&recorded); err != nil || recorded != len(all) {
		t.Fatalf("%d migrations recorded (err %v), want %d", recorded, err, len(all))
	}
}

// Every query file prepares against the migrated schema (the outbox's and
// the inbox's): no typo survives to run time.
func TestQueriesPrepare(t *testing.T) {
	pool := outboxtest.Postgres(t)
	ctx := context.Background()
	for _, up := range []func(context.Context, *pgxpool.Pool) (migrate.Result, error){migrate.UpInbox, migrate.UpLedger} {
		if _, err := up(ctx, pool); err != nil {
			t.Fatal(err)
		}
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	names, err := fs.Glob(queries.QueryFS(), "queries/*.sql")
	if err != nil || len(names) == 0 {
		t.Fatalf("no queries found: %v", err)
	}
	for _, n := range names {
		name := strings.TrimSuffix(strings.TrimPrefix(n, "queries/"), ".sql")
		if _, err := conn.Conn().Prepare(ctx, name, queries.Positional(queries.Query(name))); err != nil {
			t.Errorf("query %s: %v", name, err)
		}
	}
}

// A row inserted with only the four required columns gets working defaults.
func TestMinimalInsertGetsDefaults(t *testing.T) {
	pool := outboxtest.Postgres(t)
	ctx := context.Background()
	var status string
	var attempts int
	var seq int64
	var headers string
	err := pool.QueryRow(ctx, `INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload)
		VALUES ('order', 'o-1', 'order.placed', '{"total": 10}')
		RETURNING status, attempts, seq, headers::text`).Scan(&status, &attempts, &seq, &headers)
	if err != nil {
		t.Fatal(err)
	}
	if status != "pending" || attempts != 0 || seq <= 0 || headers != "{}" {
		t.Fatalf("defaults: status=%s attempts=%d seq=%d headers=%s", status, attempts, seq, headers)
	}
}

// at0013 is a fresh database at migration 0013, recorded as the runner
// records it, so that migrate.Up applies 0014 and what follows.
func at0013(t *testing.T) *pgxpool.Pool {
	t.Helper()
	all, err := migrate.All()
	if err != nil {
		t.Fatal(err)
	}
	pool := outboxtest.Postgres(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `DROP SCHEMA public CASCADE; CREATE SCHEMA public;
		CREATE TABLE outbox_schema_migrations (version integer PRIMARY KEY, name text NOT NULL,
			applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		t.Fatal(err)
	}
	for _, m := range all {
		if m.Version >= 14 {
			break
		}
		if _, err := pool.Exec(ctx, m.SQL); err != nil {
			t.Fatalf("%04d_%s: %v", m.Version, m.Name, err)
		}
		if _, err := pool.Exec(ctx, "INSERT INTO outbox_schema_migrations (version, name) VALUES ($1, $2)", m.Version, m.Name); err != nil {
			t.Fatal(err)
		}
	}
	return pool
}

// Migration 0014 moves the notify trigger before the insert and keeps the
// mode a database was in, and the trigger's enabled state: a database at
// 0013 in each notify mode is in the same one after it, with the trigger
// BEFORE and statement-level (or none, for off), and an outbox row inserted
// then is kept. A trigger of that name on a function of the user's is left
// as it is.
func TestNotifyTriggerMovesBeforeInEveryMode(t *testing.T) {
	for _, tc := range []struct{ name, at13, want string }{
		{"idle", "SELECT outbox_notify_mode('idle')", "outbox_messages_notify_idle before statement"},
		{"always", "SELECT outbox_notify_mode('always')", "outbox_messages_notify before statement"},
		{"off", "SELECT outbox_notify_mode('off')", ""},
		{"disabled", "ALTER TABLE outbox_messages DISABLE TRIGGER outbox_messages_notify",
			"outbox_messages_notify_idle before statement disabled"},
		{"replica", "ALTER TABLE outbox_messages ENABLE REPLICA TRIGGER outbox_messages_notify",
			"outbox_messages_notify_idle before statement replica"},
		{"theirs", `CREATE FUNCTION my_notify() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN NULL; END';
			DROP TRIGGER outbox_messages_notify ON outbox_messages;
			CREATE TRIGGER outbox_messages_notify AFTER INSERT ON outbox_messages
				FOR EACH STATEMENT EXECUTE FUNCTION my_notify()`, "my_notify after statement"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pool := at0013(t)
			ctx := context.Background()
			if _, err := pool.Exec(ctx, tc.at13); err != nil {
				t.Fatal(err)
			}
			if _, err := migrate.Up(ctx, pool); err != nil {
				t.Fatal(err)
			}
			if got := outboxtest.NotifyTrigger(t, pool); got != tc.want {
				t.Fatalf("after 0014 from %s: trigger %q, want %q", tc.name, got, tc.want)
			}
			if _, err := pool.Exec(ctx, `INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload)
				VALUES ('transfer', 'x', 'transfer.settled', '{}')`); err != nil {
				t.Fatal(err)
			}
			var n int
			if err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox_messages").Scan(&n); err != nil || n != 1 {
				t.Fatalf("%d outbox rows after one insert (err %v), want 1", n, err)
			}
		})
	}
}

// Migration 0014 re-creates the notify trigger, which locks outbox_messages;
// behind a long transaction on the table it gives up after its lock_timeout
// (5 s) instead of queueing every writer behind it, and the next run applies
// it.
func TestNotifyTriggerMigrationGivesUpBehindALongTransaction(t *testing.T) {
	all, err := migrate.All()
	if err != nil {
		t.Fatal(err)
	}
	pool := at0013(t)
	ctx := context.Background()
	long, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = long.Rollback(ctx) }()
	if _, err := long.Exec(ctx, "SELECT count(*) FROM outbox_messages"); err != nil {
		t.Fatal(err)
	}
	wait, cancel := context.WithTimeout(ctx, 20*time.Second) // without the lock_timeout it would wait for ever
	defer cancel()
	_, err = migrate.Up(wait, pool)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "55P03" {
		t.Fatalf("migrating behind a transaction that read outbox_messages: got %v, want lock_not_available", err)
	}
	if err := long.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	res, err := migrate.Up(ctx, pool)
	if err != nil || res.Current != all[len(all)-1].Version {
		t.Fatalf("the next run: %+v, %v", res, err)
	}
	if got := outboxtest.NotifyTrigger(t, pool); got != "outbox_messages_notify_idle before statement" {
		t.Fatalf("trigger %q after the next run", got)
	}
}
