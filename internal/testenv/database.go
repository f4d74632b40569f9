package testenv

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/url"
	"strings"

	"github.com/jackc/pgx/v5"
)

// maxIdentifier is PostgreSQL's default limit on identifier length (NAMEDATALEN-1).
const maxIdentifier = 63

// CreateDatabase creates a fresh uniquely named database (name starts with prefix, sanitized to [a-z0-9_], plus random suffix) on the server at adminURL
// and returns its URL (same host/credentials/query params, path replaced). drop terminates remaining connections and drops it (DROP DATABASE ... WITH (FORCE)).
func CreateDatabase(ctx context.Context, adminURL, prefix string) (dbURL string, drop func(context.Context) error, err error) {
	return CreateDatabaseFrom(ctx, adminURL, prefix, "")
}

// CreateDatabaseFrom is CreateDatabase copying the database template (no
// session may be connected to it); "" copies the server's default,
// template1.
func CreateDatabaseFrom(ctx context.Context, adminURL, prefix, template string) (dbURL string, drop func(context.Context) error, err error) {
	name, err := databaseName(prefix)
	if err != nil {
		return "", nil, err
	}
	dbURL, err = withDatabase(adminURL, name)
	if err != nil {
		return "", nil, err
	}
	create := "CREATE DATABASE " + pgx.Identifier{name}.Sanitize()
	if template != "" {
		create += " TEMPLATE " + pgx.Identifier{template}.Sanitize()
	}
	if err := adminExec(ctx, adminURL, create); err != nil {
		return "", nil, fmt.Errorf("testenv: create database %s: %w", name, err)
	}
	drop = func(ctx context.Context) error {
		if err := adminExec(ctx, adminURL, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			return fmt.Errorf("testenv: drop database %s: %w", name, err)
		}
		return nil
	}
	return dbURL, drop, nil
}

func adminExec(ctx context.Context, adminURL, sql string) error {
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	_, err = conn.Exec(ctx, sql)
	return err
}

// databaseName returns prefix reduced to [a-z0-9_] followed by "_" and a
// random suffix, within PostgreSQL's identifier length limit.
func databaseName(prefix string) (string, error) {
	var b strings.Builder
	for _, r := range strings.ToLower(prefix) {
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') || r == '_' {
			b.WriteRune(r)
		} else {
			b.WriteByte('_')
		}
	}
	clean := strings.Trim(b.String(), "_")
	if clean == "" {
		clean = "test"
	}
	var random [8]byte
	if _, err := rand.Read(random[:]); err != nil {
		return "", fmt.Errorf("testenv: random database name: %w", err)
	}
	suffix := "_" + hex.EncodeToString(random[:])
	if len(clean) > maxIdentifier-len(suffix) {
		clean = clean[:maxIdentifier-len(suffix)]
	}
	return clean + suffix, nil
}

// withDatabase returns connString pointing at database name instead. It
// accepts URLs (postgres:// or postgresql://) and keyword/value strings.
func withDatabase(connString, name string) (string, error) {
	if strings.HasPrefix(connString, "postgres://") || strings.HasPrefix(connString, "postgresql://") {
		u, err := url.Parse(connString)
		if err != nil {
			return "", fmt.Errorf("testenv: parse database URL: %w", err)
		}
		u.Path = "/" + name
		u.RawPath = ""
		return u.String(), nil
	}
	// Keyword/value form: a later setting overrides an earlier one.
	if _, err := pgx.ParseConfig(connString); err != nil {
		return "", fmt.Errorf("testenv: parse connection string: %w", err)
	}
	return strings.TrimSpace(connString) + " dbname=" + name, nil
}
