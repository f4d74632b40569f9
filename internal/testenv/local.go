package testenv

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
)

const (
	// stopGrace is how long a server may take to shut down after the polite
	// signal before it is killed.
	stopGrace = 5 * time.Second
	// portAttempts is how often a start is retried when the chosen free port
	// was taken by someone else in the meantime.
	portAttempts = 3
	// maxSocketPath is the longest Unix socket path Linux accepts (sun_path
	// is 108 bytes including the terminating NUL).
	maxSocketPath = 107
)

// LocalPostgres starts a fresh PostgreSQL server from locally installed
// binaries (initdb and postgres from PATH or /usr/lib/postgresql/*/bin, the
// highest version first) in a new temporary directory. The caller owns the
// server and must Close it.
//
// PostgreSQL refuses to run as root, so when the process runs as root the
// server runs as the "postgres" system user (or "nobody").
func LocalPostgres(ctx context.Context, opt Options) (_ *Server, err error) {
	bin, err := findPostgresBin(ctx)
	if err != nil {
		return nil, err
	}
	owner, err := serverOwner()
	if err != nil {
		return nil, err
	}
	dir, err := makeTempDir("testenv-pg-", owner)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			_ = os.RemoveAll(dir)
		}
	}()

	data := filepath.Join(dir, "data")
	initdb := exec.CommandContext(ctx, filepath.Join(bin, "initdb"),
		"-D", data, "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8", "--locale=C")
	initdb.Dir = dir
	initdb.SysProcAttr = sysProcAttr(owner)
	opt.Logf("testenv: initdb", "bin", bin, "dir", dir, "user", owner.name())
	if out, err := initdb.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("initdb in %s: %w\n%s", dir, err, tail(out))
	}
	// Clients from any loopback address (initdb trusts 127.0.0.1 only): a
	// test gives one client an address of its own to cut its link alone
	// (relay.TestHalfOpenRelayIsTakenOverWhenTheServerGivesUp).
	if err := appendFile(filepath.Join(data, "pg_hba.conf"), "host all all 127.0.0.0/8 trust\n"); err != nil {
		return nil, fmt.Errorf("pg_hba.conf in %s: %w", data, err)
	}

	// The socket lives in dir unless its path would be too long for Linux, in
	// which case the server listens on TCP only.
	socketDir := dir
	if len(dir)+len("/.s.PGSQL.65535.lock") > maxSocketPath {
		socketDir = ""
	}

	return startOnFreePort(ctx, opt, server{
		name: "postgres", bin: filepath.Join(bin, "postgres"), dir: dir, logFile: "postgres.log", owner: owner,
		stopSignal: syscall.SIGINT, // fast shutdown
		args: func(port int) []string {
			return append([]string{
				"-D", data,
				"-p", strconv.Itoa(port),
				"-k", socketDir,
				"-c", "listen_addresses=127.0.0.1",
				"-c", "fsync=off",
				"-c", "synchronous_commit=off",
				"-c", "full_page_writes=off",
				"-c", "max_connections=300",
				"-c", "dynamic_shared_memory_type=" + dsmType(dir),
			}, opt.ExtraArgs...)
		},
		url: func(port int) string {
			return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port)
		},
		ping: pingPostgres,
	})
}

// LocalRedis starts a fresh redis-server (from PATH, /usr/bin or
// /usr/local/bin) on a free port with a new temporary directory, without
// persistence unless opt.ExtraArgs asks for it. The caller owns the server
// and must Close it.
func LocalRedis(ctx context.Context, opt Options) (_ *Server, err error) {
	bin, err := findBinary("redis-server", "/usr/bin", "/usr/local/bin", "/usr/sbin")
	if err != nil {
		return nil, err
	}
	dir, err := makeTempDir("testenv-redis-", nil)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			_ = os.RemoveAll(dir)
		}
	}()

	return startOnFreePort(ctx, opt, server{
		name: "redis-server", bin: bin, dir: dir, logFile: "redis.log",
		stopSignal: syscall.SIGTERM,
		args: func(port int) []string {
			return append([]string{
				"--port", strconv.Itoa(port),
				"--bind", "127.0.0.1",
				"--save", "",
				"--appendonly", "no",
				"--dir", dir,
			}, opt.ExtraArgs...)
		},
		url:  func(port int) string { return fmt.Sprintf("redis://127.0.0.1:%d/0", port) },
		ping: pingRedis,
	})
}

// server describes how to start one kind of local server.
type server struct {
	name, bin, dir, logFile string
	owner                   *account // nil: the current user
	stopSignal              syscall.Signal
	args                    func(port int) []string
	url                     func(port int) string
	ping                    func(ctx context.Context, url string) error
}

// startOnFreePort starts srv on a free port and waits until it answers. If
// the port was taken between choosing and binding it, it tries another.
func startOnFreePort(ctx context.Context, opt Options, srv server) (*Server, error) {
	for attempt := 1; ; attempt++ {
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		u := srv.url(port)
		opt.Logf("testenv: starting local "+srv.name, "bin", srv.bin, "port", port, "dir", srv.dir)
		p, err := startProcess(srv.bin, srv.args(port), srv.dir, filepath.Join(srv.dir, srv.logFile), srv.owner, false)
		if err != nil {
			return nil, err
		}
		err = waitReady(ctx, p.done, func(ctx context.Context) error { return srv.ping(ctx, u) })
		if err == nil {
			opt.Logf("testenv: local "+srv.name+" ready", "url", u)
			dir := srv.dir
			l := &localProc{srv: srv, port: port, url: u, opt: opt, proc: p}
			return &Server{
				URL:    u,
				Source: sourceLocal,
				dir:    dir,
				local:  l,
				stop: func() error {
					l.close()
					return removeDir(dir)
				},
			}, nil
		}
		exited := p.exited()
		p.stop(syscall.SIGKILL)
		log := p.logTail()
		if attempt < portAttempts && exited && strings.Contains(log, "already in use") {
			opt.Logf("testenv: port taken, retrying", "port", port)
			continue
		}
		return nil, fmt.Errorf("%s on port %d: %w\n%s", srv.name, port, err, log)
	}
}

func pingPostgres(ctx context.Context, u string) error {
	conn, err := pgx.Connect(ctx, u)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var one int
	return conn.QueryRow(ctx, "SELECT 1").Scan(&one)
}

func pingRedis(ctx context.Context, u string) error {
	o, err := redis.ParseURL(u)
	if err != nil {
		return err
	}
	o.MaxRetries = -1 // no retries: waitReady retries
	o.DialerRetries = 1
	o.DisableIdentity = true
	// go-redis logs every failed dial through its global logger; a plain
	// dial first keeps an unready server from filling the test output.
	var d net.Dialer
	nc, err := d.DialContext(ctx, o.Network, o.Addr)
	if err != nil {
		return err
	}
	_ = nc.Close()
	c := redis.NewClient(o)
	defer c.Close()
	return c.Ping(ctx).Err()
}

func appendFile(path, text string) error {
	f, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	if _, err := f.WriteString(text); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

// dsmType is where a server whose files are in dir keeps its dynamic shared
// memory: in files of its data directory (pg_dynshmem) when dir is in
// memory already, so that a server killed with its test process leaves
// nothing behind its directory (sweep removes that); else in segments of
// /dev/shm, PostgreSQL's default (a file on disk would be written back).
func dsmType(dir string) string {
	if strings.HasPrefix(dir, memoryDir+string(filepath.Separator)) {
		return "mmap"
	}
	return "posix"
}
