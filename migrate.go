package outbox

import (
	"context"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/internal/migrate"
)

// Migration is one numbered change of the outbox's schema (the files of
// sql/migrations, embedded in the module).
type Migration struct {
	Version int    // 1, 2, ...: applied in order, each once
	Name    string // e.g. "outbox_messages"
	SQL     string // the statements
}

// Migrate brings the database behind pool to the outbox's current schema,
// from a service's own start-up code, as 'outbox migrate' does: it applies,
// in order and each in a transaction of its own, the migrations the database
// has not recorded in outbox_schema_migrations yet, and returns them (none if
// the schema is current). Concurrent runs (several replicas starting at
// once) serialize on an advisory lock and apply each migration once. The
// role needs to create tables, functions and triggers in the schema on its
// search_path.
func Migrate(ctx context.Context, pool *pgxpool.Pool) (applied []Migration, err error) {
	res, err := migrate.Up(ctx, pool)
	return migrations(res.Applied), err
}

// Migrations returns every migration in version order, for teams that apply
// schema changes with a tool of their own (copy the SQL into it; Migrate
// records what it applied in outbox_schema_migrations, a tool of your own
// does not need to).
func Migrations() ([]Migration, error) {
	all, err := migrate.All()
	return migrations(all), err
}

func migrations(ms []migrate.Migration) []Migration {
	out := make([]Migration, len(ms))
	for i, m := range ms {
		out[i] = Migration{Version: m.Version, Name: m.Name, SQL: m.SQL}
	}
	return out
}
