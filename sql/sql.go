// Package outboxsql holds the project's SQL (the directory sql/): the
// numbered schema migrations and the queries the Go code runs, embedded in
// the binary; it exports the embedded files only (internal/queries builds
// the statements). Keeping SQL in .sql files lets reviewers read it as SQL and
// lets the tests EXPLAIN it. The package is named outboxsql, not sql, so
// that it never shadows database/sql.
package outboxsql

import "embed"

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

// Queries holds queries/<name>.sql: every query the Go code runs, each
// file's comment saying what it does and what its parameters are. The Go
// code runs them through internal/queries, which reads them from here.
//
//go:embed queries/*.sql
var Queries embed.FS
