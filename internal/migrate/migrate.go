// Package migrate applies the embedded schema migrations: those of the
// outbox's database in sql/migrations (Up), and those of a consumer's own
// database, its inbox, in sql/inbox (UpInbox).
//
// Each migration runs in its own transaction together with the row that
// records it (in outbox_schema_migrations, or consumer_schema_migrations), so
// a migration is applied entirely or not at all. A session-level advisory lock serializes concurrent runs:
// two processes starting at once both succeed, and the second applies nothing.
package migrate

import (
	"context"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	outboxsql "github.com/tedbank/outbox/sql"
)

// A set of migrations: where they are, where they are recorded, and the
// advisory lock that serializes their runs.
type set struct {
	fsys  fs.FS
	dir   string
	table string
	lock  int64
}

var (
	outbox = set{outboxsql.Migrations, "migrations", "outbox_schema_migrations", 0x6f7574626f782d6d}   // "outbox-m"
	inbox  = set{outboxsql.InboxMigrations, "inbox", "consumer_schema_migrations", 0x696e626f782d6d67} // "inbox-mg"
	ledger = set{outboxsql.LedgerMigrations, "ledger", "ledger_schema_migrations", 0x6c65646765722d6d} // "ledger-m"
)

// Migration is one numbered schema change.
type Migration struct {
	Version int
	Name    string
	SQL     string
}

// Result says what a run did.
type Result struct {
	Applied []Migration // applied by this run, in order
	Current int         // schema version after the run
}

// All returns the embedded migrations of the outbox's database in version
// order.
func All() ([]Migration, error) { return load(outbox.fsys, outbox.dir) }

// AllInbox returns the embedded migrations of a consumer's inbox in version
// order.
func AllInbox() ([]Migration, error) { return load(inbox.fsys, inbox.dir) }

func load(fsys fs.FS, dir string) ([]Migration, error) {
	entries, err := fs.ReadDir(fsys, dir)
	if err != nil {
		return nil, fmt.Errorf("read migrations: %w", err)
	}
	var out []Migration
	seen := map[int]string{}
	for _, e := range entries {
		if e.IsDir() || !strings.HasSuffix(e.Name(), ".sql") {
			continue
		}
		num, name, ok := strings.Cut(strings.TrimSuffix(e.Name(), ".sql"), "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil || v <= 0 {
			return nil, fmt.Errorf("migration %q: name must be NNNN_description.sql", e.Name())
		}
		if prev, dup := seen[v]; dup {
			return nil, fmt.Errorf("migrations %q and %q share version %d", prev, e.Name(), v)
		}
		seen[v] = e.Name()
		b, err := fs.ReadFile(fsys, path.Join(dir, e.Name()))
		if err != nil {
			return nil, fmt.Errorf("read migration %q: %w", e.Name(), err)
		}
		out = append(out, Migration{Version: v, Name: name, SQL: string(b)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}

// Up applies every embedded migration of the outbox that the database has
// not recorded yet.
func Up(ctx context.Context, pool *pgxpool.Pool) (Result, error) { return apply(ctx, pool, outbox) }

// UpInbox applies every embedded migration of a consumer's inbox that the
// database has not recorded yet.
func UpInbox(ctx context.Context, pool *pgxpool.Pool) (Result, error) { return apply(ctx, pool, inbox) }

// UpLedger applies every embedded migration of the ledger example (package
// ledger) that the database has not recorded yet.
func UpLedger(ctx context.Context, pool *pgxpool.Pool) (Result, error) {
	return apply(ctx, pool, ledger)
}

func apply(ctx context.Context, pool *pgxpool.Pool, set set) (Result, error) {
	migrations, err := load(set.fsys, set.dir)
	if err != nil {
		return Result{}, err
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return Result{}, fmt.Errorf("migrate: connect: %w", err)
	}
	defer conn.Release()

	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", set.lock); err != nil {
		return Result{}, fmt.Errorf("migrate: take lock: %w", err)
	}
	defer func() {
		// Unlock even if ctx was cancelled; a broken connection drops the lock anyway.
		_, _ = conn.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock($1)", set.lock)
	}()

	// set.table is one of the two names above, never input.
	if _, err := conn.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+set.table+` (
		version    integer     PRIMARY KEY,
		name       text        NOT NULL,
		applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return Result{}, fmt.Errorf("migrate: create %s: %w", set.table, err)
	}

	var current int
	if err := conn.QueryRow(ctx, "SELECT coalesce(max(version), 0) FROM "+set.table).Scan(&current); err != nil {
		return Result{}, fmt.Errorf("migrate: read version: %w", err)
	}

	res := Result{Current: current}
	for _, m := range migrations {
		if m.Version <= current {
			continue
		}
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, "INSERT INTO "+set.table+" (version, name) VALUES ($1, $2)", m.Version, m.Name)
			return err
		})
		if err != nil {
			return res, fmt.Errorf("migrate: apply %04d_%s: %w", m.Version, m.Name, err)
		}
		res.Applied = append(res.Applied, m)
		res.Current = m.Version
	}
	return res, nil
}
