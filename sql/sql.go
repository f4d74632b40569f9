// Package sql holds the project's SQL: the numbered schema migrations and the
// queries the Go code runs, embedded in the binary. Keeping SQL in .sql files
// lets reviewers read it as SQL and lets the tests EXPLAIN it.
package sql

import (
	"embed"
	"fmt"
	"io/fs"
)

// Migrations holds migrations/NNNN_name.sql, applied in lexical order.
//
//go:embed migrations/*.sql
var Migrations embed.FS

//go:embed queries/*.sql
var queries embed.FS

// Query returns the text of queries/<name>.sql. It panics when the file is
// missing, which the package tests catch for every name the code uses.
func Query(name string) string {
	b, err := queries.ReadFile("queries/" + name + ".sql")
	if err != nil {
		panic(fmt.Sprintf("sql: no query %q: %v", name, err))
	}
	return string(b)
}

// QueryFS exposes the query files, for tests that check every one of them.
func QueryFS() fs.FS { return queries }
