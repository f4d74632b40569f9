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

// InboxMigrations holds inbox/NNNN_name.sql: the schema of a consumer's own
// database (package consumer/inbox), applied by inbox.Migrate and recorded
// in consumer_schema_migrations.
//
//go:embed inbox/*.sql
var InboxMigrations embed.FS

// LedgerMigrations holds ledger/NNNN_name.sql: the schema of the ledger
// example's database (package ledger), recorded in ledger_schema_migrations.
//
//go:embed ledger/*.sql
var LedgerMigrations embed.FS

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
// $2... in order of first appearance), as the Statements send it: for tests
// that prepare or EXPLAIN a query, or trace it by its text.
func Positional(query string) string {
	sql, _, err := pgx.NamedArgs{}.RewriteQuery(context.Background(), nil, query, nil)
	if err != nil {
		panic(fmt.Sprintf("outboxsql: rewrite named parameters: %v", err))
	}
	return sql
}

// query is one query file rewritten to positional parameters ($1, $2...,
// in order of first appearance of each @name), with, for each of them, the
// index of the function parameter that fills it.
type query struct {
	sql   string
	order []int
}

// prepare loads queries/<name>.sql and rewrites its named parameters, once.
// params are the names of the function's parameters, in its order; it
// panics unless the SQL uses exactly those names.
func prepare(name string, params ...string) query {
	index := make(pgx.StrictNamedArgs, len(params))
	for i, p := range params {
		index[p] = i
	}
	sql, order, err := index.RewriteQuery(context.Background(), nil, load(name), nil)
	if err != nil {
		panic(fmt.Sprintf("outboxsql: queries/%s.sql: %v", name, err))
	}
	q := query{sql: sql, order: make([]int, len(order))}
	for i, o := range order {
		q.order[i] = o.(int)
	}
	return q
}

// with is q with values (in the order of prepare's params) as its arguments.
func (q query) with(values ...any) Statement {
	args := make([]any, len(q.order))
	for i, j := range q.order {
		args[i] = values[j]
	}
	return Statement{SQL: q.sql, Args: args}
}
