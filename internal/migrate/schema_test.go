package migrate_test

import (
	"context"
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/internal/outboxtest"
)

var update = flag.Bool("update", false, "rewrite sql/schema.sql from a migrated database (needs pg_dump)")

const schemaFile = "../../sql/schema.sql"

// sql/schema.sql is the schema the migrations build, to read in one place.
// The test builds a database from the migrations and another from
// schema.sql and compares what the catalogs say about them: tables, columns
// (with generated expressions and defaults), constraints, indexes, sequences,
// functions and triggers. With -update it rewrites schema.sql with pg_dump.
func TestSchemaSnapshotMatchesTheMigrations(t *testing.T) {
	ctx := t.Context()
	migrated := connect(t, outboxtest.PostgresURL(t))
	if *update {
		writeSnapshot(t, migrated)
	}
	snapshot, err := os.ReadFile(schemaFile)
	if err != nil {
		t.Fatalf("%v (go test ./internal/migrate -run TestSchemaSnapshot -update writes it)", err)
	}
	fromSnapshot := connect(t, outboxtest.PostgresURL(t))
	if _, err := fromSnapshot.Exec(ctx, "DROP SCHEMA public CASCADE"); err != nil { // schema.sql creates it
		t.Fatal(err)
	}
	if _, err := fromSnapshot.Exec(ctx, string(snapshot)); err != nil {
		t.Fatalf("apply sql/schema.sql: %v", err)
	}
	want, got := catalog(t, migrated), catalog(t, fromSnapshot)
	for _, w := range want {
		if !slices.Contains(got, w) {
			t.Errorf("the migrations build, sql/schema.sql lacks:\n  %s", w)
		}
	}
	for _, g := range got {
		if !slices.Contains(want, g) {
			t.Errorf("sql/schema.sql has, the migrations do not build:\n  %s", g)
		}
	}
	if t.Failed() {
		t.Log("regenerate it: go test ./internal/migrate -run TestSchemaSnapshot -update")
	}
}

func connect(t *testing.T, url string) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(t.Context(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// catalog describes the public schema, one sorted line per object.
func catalog(t *testing.T, pool *pgxpool.Pool) []string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `
		SELECT 'column ' || table_name || '.' || column_name || ' ' || data_type || ' null=' || is_nullable
		       || ' default=' || coalesce(column_default, '') || ' generated=' || coalesce(generation_expression, '')
		  FROM information_schema.columns WHERE table_schema = 'public'
		UNION ALL
		SELECT 'constraint ' || conrelid::regclass || ' ' || pg_get_constraintdef(oid)
		  FROM pg_constraint WHERE connamespace = 'public'::regnamespace
		UNION ALL
		SELECT 'index ' || indexdef FROM pg_indexes WHERE schemaname = 'public'
		UNION ALL
		SELECT 'sequence ' || sequence_name || ' ' || data_type || ' ' || increment || ' ' || minimum_value || ' ' || maximum_value
		  FROM information_schema.sequences WHERE sequence_schema = 'public'
		UNION ALL
		SELECT 'function ' || pg_get_functiondef(oid) FROM pg_proc WHERE pronamespace = 'public'::regnamespace
		UNION ALL
		SELECT 'trigger ' || pg_get_triggerdef(oid) FROM pg_trigger
		 WHERE NOT tgisinternal AND tgrelid::regclass::text NOT LIKE 'pg_%'
		ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return lines
}

// writeSnapshot dumps the migrated schema with pg_dump, without what only a
// restore needs (session settings, ownership, psql's \restrict lines).
func writeSnapshot(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	dump, err := exec.LookPath("pg_dump")
	if err != nil {
		found, _ := filepath.Glob("/usr/lib/postgresql/*/bin/pg_dump")
		if len(found) == 0 {
			t.Fatal("-update needs pg_dump (apt-get install postgresql-client)")
		}
		dump = found[len(found)-1]
	}
	cfg := pool.Config().ConnConfig
	cmd := exec.Command(dump, "--schema-only", "--no-owner", "--no-privileges", "--no-comments", "--schema=public",
		"-h", cfg.Host, "-p", strconv.Itoa(int(cfg.Port)), "-U", cfg.User, cfg.Database)
	cmd.Env = append(os.Environ(), "PGPASSWORD="+cfg.Password)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("pg_dump: %v", err)
	}
	name := regexp.MustCompile(`^-- Name: (.*); Type: (.*); Schema: .*; Owner: .*$`)
	skip := regexp.MustCompile(`^(SET |SELECT pg_catalog\.set_config|\\restrict|\\unrestrict|-- Dumped |-- PostgreSQL database dump|--$)`)
	var b strings.Builder
	b.WriteString(`-- The outbox's schema as the migrations (sql/migrations) build it, in one
-- place, to read. Generated: go test ./internal/migrate -run TestSchemaSnapshot
-- -update (pg_dump); the test fails when it no longer matches the migrations.
-- Apply the migrations, not this file: they also insert the relay's 16
-- partition slots and set the wake-up flag, and record their versions.

-- Function bodies refer to tables created further down.
SET check_function_bodies = false;
`)
	blank := false
	for _, line := range strings.Split(string(out), "\n") {
		if skip.MatchString(line) {
			continue
		}
		line = name.ReplaceAllString(line, "-- $2 $1")
		if strings.TrimSpace(line) == "" {
			if blank {
				continue
			}
			blank = true
		} else {
			blank = false
		}
		b.WriteString(line + "\n")
	}
	if err := os.WriteFile(schemaFile, []byte(strings.TrimRight(b.String(), "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
}
