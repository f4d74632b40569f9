package migrate_test

import (
	"context"
	"io/fs"
	"strings"
	"sync"
	"testing"

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

// Migration 0014 moves the notify trigger before the insert and keeps the
// mode a database was in: a database at 0013 in each notify mode is in the
// same one after it, with the trigger BEFORE (or none, for off).
func TestNotifyTriggerMovesBeforeInEveryMode(t *testing.T) {
	all, err := migrate.All()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ mode, want string }{
		{"idle", "outbox_messages_notify_idle before"},
		{"always", "outbox_messages_notify before"},
		{"off", ""},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			pool := outboxtest.Postgres(t)
			ctx := context.Background()
			if _, err := pool.Exec(ctx, `DROP SCHEMA public CASCADE; CREATE SCHEMA public`); err != nil {
				t.Fatal(err)
			}
			trigger := func() string {
				var s string
				if err := pool.QueryRow(ctx, `SELECT coalesce(string_agg(p.proname
						|| CASE WHEN t.tgtype & 2 = 2 THEN ' before' ELSE ' after' END, ','), '')
					FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid
					WHERE t.tgrelid = 'outbox_messages'::regclass AND NOT t.tgisinternal`).Scan(&s); err != nil {
					t.Fatal(err)
				}
				return s
			}
			for _, m := range all {
				if m.Version == 14 {
					if _, err := pool.Exec(ctx, "SELECT outbox_notify_mode($1)", tc.mode); err != nil {
						t.Fatal(err)
					}
					if got := strings.Replace(tc.want, " before", " after", 1); trigger() != got {
						t.Fatalf("at 0013 in mode %s: trigger %q, want %q", tc.mode, trigger(), got)
					}
				}
				if _, err := pool.Exec(ctx, m.SQL); err != nil {
					t.Fatalf("%04d_%s: %v", m.Version, m.Name, err)
				}
			}
			if got := trigger(); got != tc.want {
				t.Fatalf("after 0014 from mode %s: trigger %q, want %q", tc.mode, got, tc.want)
			}
			var mode string
			if err := pool.QueryRow(ctx, "SELECT outbox_notify_mode($1)", tc.mode).Scan(&mode); err != nil || mode != tc.mode {
				t.Fatalf("outbox_notify_mode(%q) after 0014 = %q (err %v), want it already in that mode", tc.mode, mode, err)
			}
		})
	}
}
