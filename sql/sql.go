// Package outboxsql holds the project's SQL (the directory sql/): the
// numbered schema migrations and the queries the Go code runs, embedded in
// the binary. Keeping SQL in .sql files lets reviewers read it as SQL and
// lets the tests EXPLAIN it. The package is named outboxsql, not sql, so
// that it never shadows database/sql.
package outboxsql

import (
	"context"
	"embed"
	"fmt"
	"io/fs"

	"github.com/jackc/pgx/v5"
)

// Migrations holds migrations/NNNN_name.sql, applied in lexical order.
//
//go:embed migrations/*.sql
var Migrations embed.FS

//go:embed queries/*.sql
var queries embed.FS

// loaded are the queries load read, by name.
var loaded = map[string]string{}

// load returns the text of queries/<name>.sql, and panics if the file is
// missing (at package initialization: queries.go).
func load(name string) string {
	b, err := queries.ReadFile("queries/" + name + ".sql")
	if err != nil {
		panic(fmt.Sprintf("outboxsql: no query %q: %v", name, err))
	}
	loaded[name] = string(b)
	return string(b)
}

// Query returns the text of queries/<name>.sql, or "" if queries.go does
// not load it (a test checks that it loads every file). Code uses the
// variables of queries.go; Query is for tests that go through every query.
func Query(name string) string { return loaded[name] }

// QueryFS exposes the query files, for tests that check every one of them.
func QueryFS() fs.FS { return queries }

// Positional returns query with its named parameters (@name) numbered ($1,
// $2... in order of first appearance), as pgx sends it with
// pgx.StrictNamedArgs: for tests that prepare or EXPLAIN a query, or trace
// it by its text.
func Positional(query string) string {
	sql, _, err := pgx.NamedArgs{}.RewriteQuery(context.Background(), nil, query, nil)
	if err != nil {
		panic(fmt.Sprintf("outboxsql: rewrite named parameters: %v", err))
	}
	return sql
}
