package testenv

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// LocalPgBouncer starts a PgBouncer (from PATH, /usr/sbin or /usr/bin: the
// Debian package pgbouncer) on a free port in front of the PostgreSQL at
// upstreamURL, pooling every database in poolMode ("transaction" or
// "session"), with trust authentication for the upstream URL's user. The URL
// of the returned Server is upstreamURL with host and port replaced by
// PgBouncer's (in transaction mode with default_query_exec_mode=exec: pgx
// must not keep prepared statements across transactions). PgBouncer refuses to run as root: as root it runs as
// "postgres" or "nobody", like LocalPostgres. The caller must Close it.
func LocalPgBouncer(ctx context.Context, upstreamURL, poolMode string, opt Options) (_ *Server, err error) {
	bin, err := findBinary("pgbouncer", "/usr/sbin", "/usr/bin", "/usr/local/bin")
	if err != nil {
		return nil, fmt.Errorf("%w (install the pgbouncer package)", err)
	}
	up, err := url.Parse(upstreamURL)
	if err != nil {
		return nil, fmt.Errorf("upstream URL: %w", err)
	}
	owner, err := serverOwner()
	if err != nil {
		return nil, err
	}
	dir, err := makeTempDir("testenv-pgbouncer-", owner)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			_ = os.RemoveAll(dir)
		}
	}()
	userName := up.User.Username()
	if userName == "" {
		userName = "postgres"
	}
	host, port := up.Hostname(), up.Port()
	if port == "" {
		port = "5432"
	}
	if err := writeOwned(filepath.Join(dir, "userlist.txt"), fmt.Sprintf("%q \"\"\n", userName), owner); err != nil {
		return nil, err
	}
	return startOnFreePort(ctx, opt, server{
		name: "pgbouncer", bin: bin, dir: dir, logFile: "pgbouncer.log", owner: owner,
		stopSignal: syscall.SIGINT,
		args: func(listen int) []string {
			ini := strings.Join([]string{
				"[databases]",
				fmt.Sprintf("* = host=%s port=%s", host, port),
				"[pgbouncer]",
				"listen_addr = 127.0.0.1",
				"listen_port = " + strconv.Itoa(listen),
				"unix_socket_dir =",
				"auth_type = trust",
				"auth_file = " + filepath.Join(dir, "userlist.txt"),
				"pool_mode = " + poolMode,
				"max_client_conn = 200",
				"default_pool_size = 20",
				"ignore_startup_parameters = extra_float_digits",
				"pidfile = " + filepath.Join(dir, "pgbouncer.pid"),
				"",
			}, "\n")
			if err := writeOwned(filepath.Join(dir, "pgbouncer.ini"), ini, owner); err != nil {
				// PgBouncer then exits at once, and its log says why.
				opt.Logf("testenv: pgbouncer.ini", "error", err)
			}
			return []string{filepath.Join(dir, "pgbouncer.ini")}
		},
		url: func(listen int) string {
			u := *up
			u.Host = "127.0.0.1:" + strconv.Itoa(listen)
			if poolMode == "transaction" {
				// Consecutive transactions may run on different server
				// connections: no prepared statements kept across them.
				q := u.Query()
				q.Set("default_query_exec_mode", "exec")
				u.RawQuery = q.Encode()
			}
			return u.String()
		},
		ping: pingPostgres,
	})
}

// writeOwned writes content to path, owned by owner if not nil.
func writeOwned(path, content string, owner *account) error {
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		return err
	}
	if owner != nil {
		return os.Chown(path, int(owner.uid), int(owner.gid))
	}
	return nil
}
