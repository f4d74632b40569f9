package testenv

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
)

func testOptions(t *testing.T) Options {
	return Options{Log: func(msg string, args ...any) {
		t.Helper()
		t.Log(append([]any{msg}, args...)...)
	}}
}

func connectPostgres(t *testing.T, ctx context.Context, u string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(ctx, u)
	if err != nil {
		t.Fatalf("connect %s: %v", u, err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

// assertStopped checks that nothing listens at the URL's address any more
// and that dir is gone.
func assertStopped(t *testing.T, rawURL, dir string) {
	t.Helper()
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	if c, err := net.DialTimeout("tcp", u.Host, time.Second); err == nil {
		_ = c.Close()
		t.Errorf("%s still accepts connections after Close", u.Host)
	}
	if dir == "" {
		t.Fatal("server has no temporary directory")
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("temporary directory %s still exists after Close (stat: %v)", dir, err)
	}
}

func TestLocalPostgres(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s, err := LocalPostgres(ctx, testOptions(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })

	if s.Source != "local" {
		t.Errorf("Source = %q, want local", s.Source)
	}
	if !strings.HasPrefix(s.URL, "postgres://postgres@127.0.0.1:") || !strings.HasSuffix(s.URL, "/postgres?sslmode=disable") {
		t.Errorf("URL = %q, want postgres://postgres@127.0.0.1:PORT/postgres?sslmode=disable", s.URL)
	}
	if fi, err := os.Stat(s.dir); err != nil || !fi.IsDir() {
		t.Fatalf("temporary directory %q: %v", s.dir, err)
	}
	if base := tempBase(); filepath.Dir(s.dir) != base && traversable(base) {
		t.Errorf("the server's files are in %s, want a directory under %s", s.dir, base)
	}

	conn := connectPostgres(t, ctx, s.URL)
	var user, maxConns string
	var super bool
	if err := conn.QueryRow(ctx, "SELECT current_user, current_setting('max_connections'), current_setting('is_superuser') = 'on'").
		Scan(&user, &maxConns, &super); err != nil {
		t.Fatal(err)
	}
	if user != "postgres" || maxConns != "300" || !super {
		t.Errorf("user=%q max_connections=%q superuser=%v, want postgres, 300, true", user, maxConns, super)
	}

	// CreateDatabase gives a usable, empty, uniquely named database.
	dbURL, drop, err := CreateDatabase(ctx, s.URL, "Outbox Test-1!")
	if err != nil {
		t.Fatal(err)
	}
	parsed, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	name := strings.TrimPrefix(parsed.Path, "/")
	if !strings.HasPrefix(name, "outbox_test_1_") || strings.Trim(name, "abcdefghijklmnopqrstuvwxyz0123456789_") != "" {
		t.Errorf("database name %q, want outbox_test_1_<random> in [a-z0-9_]", name)
	}
	if parsed.RawQuery != "sslmode=disable" || parsed.User.Username() != "postgres" {
		t.Errorf("database URL %q lost the credentials or query of %q", dbURL, s.URL)
	}
	db := connectPostgres(t, ctx, dbURL)
	var current string
	if err := db.QueryRow(ctx, "SELECT current_database()").Scan(&current); err != nil {
		t.Fatal(err)
	}
	if current != name {
		t.Errorf("current_database() = %q, want %q", current, name)
	}
	if _, err := db.Exec(ctx, "CREATE TABLE t (id int); INSERT INTO t VALUES (1)"); err != nil {
		t.Fatal(err)
	}

	dbURL2, drop2, err := CreateDatabase(ctx, s.URL, "Outbox Test-1!")
	if err != nil {
		t.Fatal(err)
	}
	if dbURL2 == dbURL {
		t.Errorf("two databases got the same URL %s", dbURL)
	}
	if err := drop2(ctx); err != nil {
		t.Fatal(err)
	}

	// drop works while db is still connected, and removes the database.
	if err := drop(ctx); err != nil {
		t.Fatal(err)
	}
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", name).Scan(&exists); err != nil {
		t.Fatal(err)
	}
	if exists {
		t.Errorf("database %s still exists after drop", name)
	}
	if err := drop(ctx); err != nil {
		t.Errorf("second drop: %v", err)
	}

	_ = conn.Close(ctx)
	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	assertStopped(t, s.URL, s.dir)
	if err := s.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// Throw-away servers keep their files in memory where the machine has a
// memory-backed directory with room, unless TMPDIR says where.
func TestServersKeepTheirFilesInMemoryWhereThereIsRoom(t *testing.T) {
	dir := t.TempDir()
	// t.TempDir's parent is its owner's only.
	if err := os.Chmod(filepath.Dir(dir), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o1777); err != nil {
		t.Fatal(err)
	}
	if !roomy(dir, 1) {
		t.Errorf("roomy(%s, 1 byte) = false for a directory anyone may write to", dir)
	}
	if roomy(dir, 1<<62) {
		t.Errorf("roomy(%s, 4 EiB) = true", dir)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if roomy(dir, 1) {
		t.Errorf("roomy(%s) = true for a directory only its owner may write to", dir)
	}
	if roomy(filepath.Join(dir, "missing"), 1) {
		t.Error("roomy = true for a directory that does not exist")
	}

	t.Setenv("TMPDIR", dir)
	if got := tempBase(); got != dir {
		t.Errorf("with TMPDIR=%s, tempBase() = %s", dir, got)
	}
	t.Setenv("TMPDIR", "")
	want := os.TempDir()
	if roomy(memoryDir, memoryDirRoom) {
		want = memoryDir
	}
	if got := tempBase(); got != want {
		t.Errorf("without TMPDIR, tempBase() = %s, want %s", got, want)
	}
}

func TestLocalPostgresExtraArgs(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	opt := testOptions(t)
	opt.ExtraArgs = []string{"-c", "application_name=testenv_extra"}
	s, err := LocalPostgres(ctx, opt)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var v string
	if err := connectPostgres(t, ctx, s.URL).QueryRow(ctx, "SHOW application_name").Scan(&v); err != nil {
		t.Fatal(err)
	}
	// The server-wide default is overridden by pgx's own application_name
	// only if it sets one; it does not, so the -c setting shows.
	if v != "testenv_extra" {
		t.Errorf("application_name = %q, want testenv_extra", v)
	}
}

func TestLocalRedis(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	opt := testOptions(t)
	opt.ExtraArgs = []string{"--appendonly", "yes"}
	s, err := LocalRedis(ctx, opt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })

	if s.Source != "local" {
		t.Errorf("Source = %q, want local", s.Source)
	}
	if !strings.HasPrefix(s.URL, "redis://127.0.0.1:") || !strings.HasSuffix(s.URL, "/0") {
		t.Errorf("URL = %q, want redis://127.0.0.1:PORT/0", s.URL)
	}
	o, err := redis.ParseURL(s.URL)
	if err != nil {
		t.Fatal(err)
	}
	c := redis.NewClient(o)
	defer c.Close()
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if got, err := c.Get(ctx, "k").Result(); err != nil || got != "v" {
		t.Errorf("GET k = %q, %v; want v", got, err)
	}
	cfg, err := c.ConfigGet(ctx, "appendonly").Result()
	if err != nil {
		t.Fatal(err)
	}
	if cfg["appendonly"] != "yes" {
		t.Errorf("appendonly = %q, want yes (from ExtraArgs)", cfg["appendonly"])
	}
	if cfg, err := c.ConfigGet(ctx, "save").Result(); err != nil || cfg["save"] != "" {
		t.Errorf("save = %q, %v; want empty", cfg["save"], err)
	}
	_ = c.Close()

	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	assertStopped(t, s.URL, s.dir)
	if err := s.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// TestPostgresFallsThrough checks that with the variable unset, Postgres
// still finds a working server (on a machine without Docker: a local one).
func TestPostgresFallsThrough(t *testing.T) {
	const envVar = "TESTENV_TEST_UNSET_DATABASE_URL"
	t.Setenv(envVar, "")
	ctx := t.Context()
	opt := testOptions(t)
	opt.EnvVar = envVar
	s, err := Postgres(ctx, opt)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	t.Logf("source %s, URL %s", s.Source, s.URL)
	if s.Source != "docker" && s.Source != "local" {
		t.Errorf("Source = %q, want docker or local", s.Source)
	}
	var one int
	if err := connectPostgres(t, ctx, s.URL).QueryRow(ctx, "SELECT 1").Scan(&one); err != nil || one != 1 {
		t.Fatalf("SELECT 1 = %d, %v", one, err)
	}
}

func TestRedisFallsThrough(t *testing.T) {
	const envVar = "TESTENV_TEST_UNSET_REDIS_URL"
	t.Setenv(envVar, "")
	ctx := t.Context()
	opt := testOptions(t)
	opt.EnvVar = envVar
	s, err := Redis(ctx, opt)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	t.Logf("source %s, URL %s", s.Source, s.URL)
	if err := pingRedis(ctx, s.URL); err != nil {
		t.Fatal(err)
	}
}

func TestEnvVar(t *testing.T) {
	ctx := t.Context()
	local, err := LocalRedis(ctx, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer local.Close()

	const envVar = "TESTENV_TEST_REDIS_URL"
	t.Setenv(envVar, local.URL)
	s, err := Redis(ctx, Options{EnvVar: envVar})
	if err != nil {
		t.Fatal(err)
	}
	if s.Source != "env" || s.URL != local.URL {
		t.Errorf("got %s server at %s, want env server at %s", s.Source, s.URL, local.URL)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := pingRedis(ctx, local.URL); err != nil {
		t.Errorf("Close of an env server stopped it: %v", err)
	}

	// A set but unusable URL is an error, not a silent fallback.
	t.Setenv(envVar, "redis://:secret@127.0.0.1:1/0")
	short, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	_, err = Redis(short, Options{EnvVar: envVar})
	if err == nil || !strings.Contains(err.Error(), envVar) || strings.Contains(err.Error(), "secret") {
		t.Errorf("unusable %s: err = %v, want an error naming it without the password", envVar, err)
	}
}

func TestUnavailableErrorSaysHowToGetOne(t *testing.T) {
	t.Parallel()
	cause := errors.New("initdb not found")
	err := newUnavailableError(postgresKind, "TEST_DATABASE_URL", []error{
		errors.New("TEST_DATABASE_URL is not set"),
		fmt.Errorf("local: %w", cause),
	})
	if !errors.Is(err, cause) {
		t.Errorf("error does not wrap its causes")
	}
	for _, want := range []string{
		"no PostgreSQL server available",
		"initdb not found",
		"set TEST_DATABASE_URL",
		"Docker",
		"apt-get install -y postgresql",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q:\n%s", want, err)
		}
	}
	if msg := newUnavailableError(redisKind, "", nil).Error(); !strings.Contains(msg, "apt-get install -y redis-server") || !strings.Contains(msg, "Options.EnvVar") {
		t.Errorf("redis error:\n%s", msg)
	}
}

func TestDatabaseName(t *testing.T) {
	t.Parallel()
	for prefix, want := range map[string]string{
		"Outbox":                 "outbox_",
		"a-b c.D":                "a_b_c_d_",
		"":                       "test_",
		"!!!":                    "test_",
		strings.Repeat("x", 100): strings.Repeat("x", maxIdentifier-17) + "_",
	} {
		name, err := databaseName(prefix)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(name, want) || len(name) != len(want)+16 || len(name) > maxIdentifier {
			t.Errorf("databaseName(%q) = %q, want %s<16 hex>", prefix, name, want)
		}
	}
}

func TestWithDatabase(t *testing.T) {
	t.Parallel()
	got, err := withDatabase("postgres://u:p@h:5432/postgres?sslmode=disable&x=y", "db1")
	if err != nil || got != "postgres://u:p@h:5432/db1?sslmode=disable&x=y" {
		t.Errorf("URL form: %q, %v", got, err)
	}
	got, err = withDatabase("host=h user=u dbname=postgres", "db1")
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := pgx.ParseConfig(got)
	if err != nil || cfg.Database != "db1" || cfg.User != "u" {
		t.Errorf("keyword/value form: %q -> %+v, %v", got, cfg, err)
	}
}

// A test process killed outright leaves its servers' directories: the next
// one removes those whose maker is gone, and nothing else.
func TestSweepRemovesTheDirectoriesOfTestProcessesThatAreGone(t *testing.T) {
	base := t.TempDir()
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	self := processID(os.Getpid())
	if self == "" {
		t.Fatal("processID of this process is empty")
	}
	dirs := map[string]struct {
		maker string // "": no maker file
		kept  bool
	}{
		"testenv-pg-exited":     {fmt.Sprintf("%d 1", gone.Process.Pid), false},
		"testenv-redis-reused":  {fmt.Sprintf("%d 0", os.Getpid()), false}, // its pid, another start time
		"testenv-pg-running":    {self, true},
		"testenv-nats-nomaker":  {"", true},
		"somethingelse-exited":  {fmt.Sprintf("%d 1", gone.Process.Pid), true},
		"testenv-pg-unreadable": {"not a pid", true},
	}
	for name, d := range dirs {
		dir := filepath.Join(base, name)
		if err := os.MkdirAll(filepath.Join(dir, "data"), 0o755); err != nil {
			t.Fatal(err)
		}
		if d.maker != "" {
			if err := os.WriteFile(filepath.Join(dir, makerFile), []byte(d.maker), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	sweep(base)
	for name, d := range dirs {
		_, err := os.Stat(filepath.Join(base, name))
		if kept := err == nil; kept != d.kept {
			t.Errorf("%s (maker %q): kept %v, want %v", name, d.maker, kept, d.kept)
		}
	}

	// makeTempDir records this process as the maker, and a sweep keeps it.
	t.Setenv("TMPDIR", base)
	dir, err := makeTempDir("testenv-pg-", nil)
	if err != nil {
		t.Fatal(err)
	}
	if maker, err := os.ReadFile(filepath.Join(dir, makerFile)); err != nil || string(maker) != self {
		t.Errorf("maker file %q, %v; want %q", maker, err, self)
	}
	sweep(base)
	if _, err := os.Stat(dir); err != nil {
		t.Errorf("the sweep removed a running process's directory: %v", err)
	}
}
