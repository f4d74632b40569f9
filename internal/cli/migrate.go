package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/internal/connect"
	"github.com/tedbank/outbox/internal/migrate"
)

func runMigrate(ctx context.Context, e *env, args []string) error {
	var c common
	fs := e.flags("migrate", &c)
	if err := e.parse(fs, args); err != nil {
		return err
	}
	log, err := c.logger(e.stderr)
	if err != nil {
		return err
	}
	pool, err := connect.Postgres(ctx, c.databaseURL, connect.PostgresOptions{AppName: "outbox-migrate", MaxConns: 2})
	if err != nil {
		return err
	}
	defer pool.Close()
	res, err := migrate.Up(ctx, pool)
	if err != nil {
		return err
	}
	for _, m := range res.Applied {
		log.Info("applied migration", "version", m.Version, "name", m.Name)
	}
	cc := pool.Config().ConnConfig
	fmt.Fprintf(e.stdout, "database %s on %s:%d: schema at version %d (%d applied now)\n",
		cc.Database, cc.Host, cc.Port, res.Current, len(res.Applied))
	if cc.Database == "postgres" || cc.Database == "template1" {
		log.Warn("migrated the maintenance database "+cc.Database+"; for your service's own database, set DATABASE_URL (or --database-url) to it",
			slog.String("database", cc.Database))
	}
	return nil
}

// requireSchema fails with a clear message when migrations have not run.
// openOutbox connects to the outbox database and checks that it is
// migrated; the caller closes the pool.
func openOutbox(ctx context.Context, databaseURL string, opt connect.PostgresOptions) (*pgxpool.Pool, error) {
	pool, err := connect.Postgres(ctx, databaseURL, opt)
	if err != nil {
		return nil, err
	}
	if err := requireSchema(ctx, pool); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

func requireSchema(ctx context.Context, pool *pgxpool.Pool) error {
	var ok bool
	err := pool.QueryRow(ctx, "SELECT to_regclass('outbox_messages') IS NOT NULL AND to_regclass('transfers') IS NOT NULL").Scan(&ok)
	if err != nil {
		return fmt.Errorf("check schema: %w", err)
	}
	if !ok {
		return errNotMigrated
	}
	return nil
}

// errNotMigrated: the database answers but has not the outbox's tables.
var errNotMigrated = errors.New("tables outbox_messages/transfers not found: run 'outbox migrate' first")
