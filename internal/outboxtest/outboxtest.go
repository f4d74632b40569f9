// Package outboxtest gives integration tests real, isolated servers: one
// PostgreSQL and one Redis per test binary (from TEST_DATABASE_URL and
// TEST_REDIS_URL, else Docker, else local binaries; see internal/testenv), a
// fresh migrated database per test, and a unique Redis key prefix per test.
// There is no skip path: without servers the test binary fails and says how
// to get them.
package outboxtest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/connect"
	"github.com/tedbank/outbox/internal/migrate"
	"github.com/tedbank/outbox/internal/testenv"
	_ "github.com/tedbank/outbox/internal/testenv/containers" // the Docker step
)

var (
	pgServer, redisServer *testenv.Server
	natsOnce              sync.Once
	natsServer            *testenv.Server
	natsErr               error
	binOnce               sync.Once
	binPath               string
	binErr                error
	binDir                string
)

// Main starts the servers, runs the tests and stops the servers. Call it from
// TestMain: func TestMain(m *testing.M) { outboxtest.Main(m) }.
func Main(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var err error
	pgServer, err = testenv.Postgres(ctx, testenv.Options{EnvVar: "TEST_DATABASE_URL"})
	if err != nil {
		fmt.Fprintf(os.Stderr, "outboxtest: no PostgreSQL for the integration tests:\n%v\n", err)
		return 1
	}
	defer pgServer.Close()
	redisServer, err = testenv.Redis(ctx, testenv.Options{EnvVar: "TEST_REDIS_URL"})
	if err != nil {
		fmt.Fprintf(os.Stderr, "outboxtest: no Redis for the integration tests:\n%v\n", err)
		return 1
	}
	defer redisServer.Close()
	defer func() {
		if natsServer != nil {
			_ = natsServer.Close()
		}
	}()
	defer func() {
		if templateDrop != nil {
			_ = templateDrop(context.Background())
		}
	}()
	defer func() {
		if binDir != "" {
			_ = os.RemoveAll(binDir)
		}
	}()
	if examplePrefix != "" {
		cleanup, err := exampleEnv(ctx)
		if err != nil {
			fmt.Fprintf(os.Stderr, "outboxtest: set up the examples' database: %v\n", err)
			return 1
		}
		defer cleanup()
	}
	return m.Run()
}

// examplePrefix is set by MainWithExamples: the runnable examples' Redis
// keys, removed after the run.
var examplePrefix string

// MainWithExamples is Main for packages with runnable examples: they read
// DATABASE_URL (a fresh migrated database) and REDIS_URL, as a service would,
// and keep their Redis keys under redisPrefix (one per package: the
// packages' test binaries run side by side on one Redis), which is removed
// after the run.
func MainWithExamples(m *testing.M, redisPrefix string) {
	if redisPrefix == "" {
		fmt.Fprintln(os.Stderr, "outboxtest: MainWithExamples needs a Redis key prefix")
		os.Exit(2)
	}
	examplePrefix = redisPrefix
	os.Exit(run(m))
}

func exampleEnv(ctx context.Context) (cleanup func(), err error) {
	template, err := migratedTemplate()
	if err != nil {
		return nil, err
	}
	dbURL, drop, err := testenv.CreateDatabaseFrom(ctx, pgServer.URL, "examples", template)
	if err != nil {
		return nil, err
	}
	os.Setenv("DATABASE_URL", dbURL)
	os.Setenv("REDIS_URL", redisServer.URL)
	return func() {
		_ = drop(context.Background())
		opt, err := redis.ParseURL(redisServer.URL)
		if err != nil {
			return
		}
		rdb := redis.NewClient(opt)
		defer rdb.Close()
		iter := rdb.Scan(context.Background(), 0, examplePrefix+"*", 1000).Iterator()
		for iter.Next(context.Background()) {
			rdb.Del(context.Background(), iter.Val())
		}
	}, nil
}

// PostgresURL returns the URL of a fresh, migrated database that is dropped
// when t ends.
func PostgresURL(t testing.TB) string {
	t.Helper()
	if pgServer == nil {
		t.Fatal("outboxtest: servers not started; call outboxtest.Main from TestMain")
	}
	ctx := context.Background()
	name := strings.NewReplacer("/", "_", "-", "_").Replace(strings.ToLower(t.Name()))
	if len(name) > 30 {
		name = name[:30]
	}
	template, err := migratedTemplate()
	if err != nil {
		t.Fatalf("outboxtest: the migrated template database: %v", err)
	}
	dbURL, drop, err := testenv.CreateDatabaseFrom(ctx, pgServer.URL, "t_"+name, template)
	if err != nil {
		t.Fatalf("create test database: %v", err)
	}
	t.Cleanup(func() {
		if err := drop(context.Background()); err != nil {
			t.Errorf("drop test database: %v", err)
		}
	})
	return dbURL
}

var (
	templateOnce sync.Once
	templateName string
	templateDrop func(context.Context) error
	templateErr  error
)

// migratedTemplate returns the name of the test binary's template database:
// created and migrated on first use, dropped after the run. A test's
// database is a copy of it (CREATE DATABASE ... TEMPLATE), which costs a
// fraction of running every migration again.
func migratedTemplate() (string, error) {
	templateOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		var dbURL string
		dbURL, templateDrop, templateErr = testenv.CreateDatabase(ctx, pgServer.URL, "template_outbox")
		if templateErr != nil {
			return
		}
		templateName, templateErr = databaseOf(dbURL)
		if templateErr != nil {
			return
		}
		var pool *pgxpool.Pool
		pool, templateErr = pgxpool.New(ctx, dbURL)
		if templateErr != nil {
			return
		}
		// Closed before any copy: CREATE DATABASE refuses a template that
		// has sessions.
		defer pool.Close()
		if _, err := migrate.Up(ctx, pool); err != nil {
			templateErr = fmt.Errorf("migrate: %w", err)
		}
	})
	return templateName, templateErr
}

// databaseOf returns the database named in a connection URL.
func databaseOf(dbURL string) (string, error) {
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		return "", err
	}
	return cfg.ConnConfig.Database, nil
}

// Postgres returns a pool to a fresh, migrated database, closed and dropped
// when t ends.
func Postgres(t testing.TB) *pgxpool.Pool {
	t.Helper()
	pool := newPool(t, PostgresURL(t), "outbox-test")
	t.Cleanup(pool.Close)
	return pool
}

func newPool(t testing.TB, dbURL, app string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		t.Fatalf("parse database URL: %v", err)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	cfg.MaxConns = 16
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	return pool
}

// Redis is a client plus the unique key prefix a test must put in front of
// every key it uses (streams included).
type Redis struct {
	*redis.Client
	URL    string
	Prefix string
}

// NewRedis returns a client and a key prefix of t's own; every key under the
// prefix is deleted when t ends.
func NewRedis(t testing.TB) Redis {
	t.Helper()
	if redisServer == nil {
		t.Fatal("outboxtest: servers not started; call outboxtest.Main from TestMain")
	}
	opt, err := redis.ParseURL(redisServer.URL)
	if err != nil {
		t.Fatalf("parse redis URL: %v", err)
	}
	opt.ClientName = "outbox-test"
	rdb := redis.NewClient(opt)
	prefix := "t-" + uuid.NewString()[:8] + ":"
	t.Cleanup(func() {
		ctx := context.Background()
		_ = connect.DeleteKeys(ctx, rdb, prefix+"*")
		_ = rdb.Close()
	})
	return Redis{Client: rdb, URL: redisServer.URL, Prefix: prefix}
}

// OwnNATS starts a nats-server with JetStream of t's own from the local
// binary, for a test that kills or restarts it (Kill, Start: on its port,
// with its store); it goes when t ends.
func OwnNATS(t testing.TB) *testenv.Server {
	t.Helper()
	srv, err := testenv.LocalNATS(context.Background(), testenv.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	return srv
}

// OwnRedis starts a Redis server of t's own from the local redis-server
// binary, with args (redis-server options), for a test that changes what
// the whole server does (its maxmemory, its policy); both the client and
// the server go when t ends. Its Prefix is empty: every key is the test's.
func OwnRedis(t testing.TB, args ...string) Redis {
	t.Helper()
	srv, err := testenv.LocalRedis(context.Background(), testenv.Options{ExtraArgs: args})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	opt, err := redis.ParseURL(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(opt)
	t.Cleanup(func() { _ = rdb.Close() })
	return Redis{Client: rdb, URL: srv.URL}
}

// Binary builds cmd/outbox (with fail points) once per test binary and
// returns its path, for tests that run and kill the real command. When
// OUTBOX_TEST_BINARY names one, it is used instead: make test builds it
// once for all its test binaries (a link of cmd/outbox costs seconds of
// CPU, and half a dozen test binaries each linked their own).
func Binary(t testing.TB) string {
	t.Helper()
	binOnce.Do(func() {
		if p := os.Getenv("OUTBOX_TEST_BINARY"); p != "" {
			binPath = p
			if fi, err := os.Stat(p); err != nil || !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
				binErr = fmt.Errorf("OUTBOX_TEST_BINARY=%s is not an executable file (%v): unset it, or build it with go build -tags failpoint -o %s ./cmd/outbox", p, err, p)
			}
			return
		}
		binDir, binErr = os.MkdirTemp("", "outbox-bin-")
		if binErr != nil {
			return
		}
		binPath = filepath.Join(binDir, "outbox")
		cmd := exec.Command("go", "build", "-tags", "failpoint", "-o", binPath, "github.com/tedbank/outbox/cmd/outbox")
		out, err := cmd.CombinedOutput()
		if err != nil {
			binErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if binErr != nil {
		t.Fatalf("build outbox binary: %v", binErr)
	}
	return binPath
}

// Eventually polls cond every few milliseconds until it returns true or the
// timeout passes, then fails t with the message; an argument that is a
// func() any is called then, so that the message says what was so at the
// end. It bounds waits for asynchronous work; it is not a performance
// assertion.
func Eventually(t testing.TB, timeout time.Duration, cond func() bool, format string, args ...any) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		if cond() {
			return
		}
		if time.Now().After(deadline) {
			for i, a := range args {
				if f, ok := a.(func() any); ok {
					args[i] = f()
				}
			}
			t.Fatalf("after %s: "+format, append([]any{timeout}, args...)...)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// NATSURL returns the URL of the test binary's NATS server with JetStream
// (TEST_NATS_URL if set, else a nats-server process started on first use
// and stopped after the run). Tests keep apart by their own subjects and
// stream names (NATSStream).
func NATSURL(t testing.TB) string {
	t.Helper()
	natsOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		natsServer, natsErr = testenv.NATS(ctx, testenv.Options{EnvVar: "TEST_NATS_URL"})
	})
	if natsErr != nil {
		t.Fatalf("outboxtest: no NATS server for the test: %v", natsErr)
	}
	return natsServer.URL
}

// NATSStream is a JetStream stream name of t's own (letters, digits and
// '_': a stream name has no dots), deleted when t ends.
func NATSStream(t testing.TB) string {
	t.Helper()
	name := "T_" + strings.ToUpper(strings.ReplaceAll(uuid.NewString()[:13], "-", "_"))
	url := NATSURL(t)
	t.Cleanup(func() {
		nc, err := nats.Connect(url, nats.MaxReconnects(0))
		if err != nil {
			return
		}
		defer nc.Close()
		if js, err := jetstream.New(nc); err == nil {
			_ = js.DeleteStream(context.Background(), name)
		}
	})
	return name
}

// NotifyTrigger describes outbox_messages' notify trigger as "function
// timing level" ("outbox_messages_notify_idle before statement"), with
// " disabled", " replica" or " always" when it is not simply enabled; ""
// when there is none (notify mode off). The row triggers of migrations 0015
// (keys transfer.settled rows), 0016 (big payloads' sizes) and 0019 (counts
// requeues) are not notify triggers.
func NotifyTrigger(t testing.TB, pool *pgxpool.Pool) string {
	t.Helper()
	var s string
	// tgtype: bit 0 FOR EACH ROW, bit 1 BEFORE.
	if err := pool.QueryRow(context.Background(), `SELECT coalesce(string_agg(p.proname
			|| CASE WHEN t.tgtype & 2 = 2 THEN ' before' ELSE ' after' END
			|| CASE WHEN t.tgtype & 1 = 1 THEN ' row' ELSE ' statement' END
			|| CASE t.tgenabled WHEN 'D' THEN ' disabled' WHEN 'R' THEN ' replica' WHEN 'A' THEN ' always' ELSE '' END,
			','), '')
		FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid
		WHERE t.tgrelid = 'outbox_messages'::regclass AND NOT t.tgisinternal
			AND t.tgname NOT IN ('outbox_messages_key_settled', 'outbox_messages_payload_bytes', 'outbox_messages_requeued')`).Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}
