// Package testenv finds or starts a real PostgreSQL or Redis server for
// integration tests and demos. It never mocks anything.
//
// Postgres and Redis look for a server in this order:
//
//  1. the URL in the environment variable named by Options.EnvVar, if set;
//  2. a container started through testcontainers-go, if a Docker engine is
//     reachable (checked first, with a short timeout, so a machine without
//     one fails over quickly) and the binary imports
//     internal/testenv/containers (the test helpers do; the outbox command
//     does not, to stay free of the Docker client);
//  3. a server process started from locally installed binaries (initdb and
//     postgres, or redis-server) in a fresh temporary directory: under
//     /dev/shm (memory) when it has a GiB free and TMPDIR is not set, else
//     under TMPDIR or /tmp.
//
// LocalPostgres and LocalRedis skip the first two steps and always start a
// fresh process owned by the caller, for tests that stop or restart servers.
//
// Every Server must be closed; Close stops what was started and removes its
// files.
package testenv

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"
)

// Sources reported in Server.Source.
const (
	sourceEnv    = "env"
	SourceDocker = "docker"
	sourceLocal  = "local"
)

// The images the Docker step runs (internal/testenv/containers).
const (
	PostgresImage = "postgres:16-alpine"
	RedisImage    = "redis:7-alpine"
)

// A Starter starts a server for the caller.
type Starter func(ctx context.Context, opt Options) (*Server, error)

// dockerPostgres, dockerRedis and dockerNATS are the Docker step: nil
// unless UseDocker installed them.
var dockerPostgres, dockerRedis, dockerNATS Starter

// UseDocker installs the Docker step of Postgres, Redis and NATS. Package
// internal/testenv/containers calls it from its init, before any caller
// looks for a server.
func UseDocker(postgres, redis, nats Starter) {
	dockerPostgres, dockerRedis, dockerNATS = postgres, redis, nats
}

// errNoDocker: this binary has no Docker step.
var errNoDocker = errors.New("not in this binary (only tests import internal/testenv/containers)")

// NewServer returns a Server at url that Close releases with stop.
func NewServer(url, source string, stop func() error) *Server {
	return &Server{URL: url, Source: source, stop: stop}
}

// readyTimeout bounds how long a server may take to accept connections.
const readyTimeout = 30 * time.Second

// Options selects how a server is found.
type Options struct {
	EnvVar    string                        // environment variable holding a URL; "" = don't look
	NoDocker  bool                          // skip the testcontainers path
	Log       func(msg string, args ...any) // optional progress logger (slog-style key/values); nil = silent
	ExtraArgs []string                      // extra server args for local (and docker) servers, e.g. "-c", "x=y" or "--appendonly", "yes"
}

// Logf logs progress through o.Log, if set.
func (o Options) Logf(msg string, args ...any) {
	if o.Log != nil {
		o.Log(msg, args...)
	}
}

// Server is a running (or external) server.
type Server struct {
	URL    string // postgres://... (superuser, database "postgres") or redis://127.0.0.1:port/0
	Source string // "env", "docker" or "local"

	dir   string       // temporary directory of a local server, removed by Close
	stop  func() error // releases the server; nil for "env"
	local *localProc   // the process of a local server; nil otherwise

	closeOnce sync.Once
	closeErr  error
}

// Close stops a server that was started for the caller and removes its
// files. It is a no-op for a server from the environment and safe to call
// more than once.
func (s *Server) Close() error {
	if s == nil {
		return nil
	}
	s.closeOnce.Do(func() {
		if s.stop != nil {
			s.closeErr = s.stop()
		}
	})
	return s.closeErr
}

// kind describes one type of server and how to obtain it.
type kind struct {
	name       string // human name, e.g. "PostgreSQL"
	exampleURL string
	image      string // docker image
	aptPackage string
	ping       func(ctx context.Context, url string) error
	docker     func() Starter // the Docker step, nil if not installed
	local      func(ctx context.Context, opt Options) (*Server, error)
}

var (
	postgresKind = kind{
		name:       "PostgreSQL",
		exampleURL: "postgres://postgres:postgres@127.0.0.1:5432/postgres?sslmode=disable",
		image:      PostgresImage,
		aptPackage: "postgresql",
		ping:       pingPostgres,
		docker:     func() Starter { return dockerPostgres },
		local:      LocalPostgres,
	}
	redisKind = kind{
		name:       "Redis",
		exampleURL: "redis://127.0.0.1:6379/0",
		image:      RedisImage,
		aptPackage: "redis-server",
		ping:       pingRedis,
		docker:     func() Starter { return dockerRedis },
		local:      LocalRedis,
	}
)

// Postgres returns a PostgreSQL server: from opt.EnvVar, else a Docker
// container, else a local server process. Its URL connects as a superuser
// to the database "postgres".
func Postgres(ctx context.Context, opt Options) (*Server, error) {
	return find(ctx, opt, postgresKind)
}

// Redis returns a Redis server: from opt.EnvVar, else a Docker container,
// else a local redis-server process.
func Redis(ctx context.Context, opt Options) (*Server, error) {
	return find(ctx, opt, redisKind)
}

func find(ctx context.Context, opt Options, k kind) (*Server, error) {
	var reasons []error

	if opt.EnvVar != "" {
		if u := strings.TrimSpace(os.Getenv(opt.EnvVar)); u != "" {
			// The caller asked for this server explicitly: if it does not
			// work, say so rather than silently starting another one.
			if err := waitReady(ctx, nil, func(ctx context.Context) error { return k.ping(ctx, u) }); err != nil {
				return nil, fmt.Errorf("testenv: %s is set, but the %s server at %s is not usable: %w",
					opt.EnvVar, k.name, redact(u), err)
			}
			opt.Logf("testenv: using server from environment", "kind", k.name, "var", opt.EnvVar)
			return &Server{URL: u, Source: sourceEnv}, nil
		}
		reasons = append(reasons, fmt.Errorf("%s is not set", opt.EnvVar))
	}

	if opt.NoDocker {
		reasons = append(reasons, errors.New("docker: skipped (Options.NoDocker)"))
	} else if start := k.docker(); start == nil {
		reasons = append(reasons, fmt.Errorf("docker: %w", errNoDocker))
	} else {
		s, err := start(ctx, opt)
		if err == nil {
			return s, nil
		}
		opt.Logf("testenv: docker unavailable, trying local binaries", "kind", k.name, "err", err)
		reasons = append(reasons, fmt.Errorf("docker: %w", err))
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("testenv: looking for a %s server: %w", k.name, err)
	}

	s, err := k.local(ctx, opt)
	if err == nil {
		return s, nil
	}
	reasons = append(reasons, fmt.Errorf("local: %w", err))
	return nil, newUnavailableError(k, opt.EnvVar, reasons)
}

// unavailableError reports that no server of a kind could be found, why, and
// how to get one.
type unavailableError struct {
	msg     string
	reasons []error
}

func (e *unavailableError) Error() string   { return e.msg }
func (e *unavailableError) Unwrap() []error { return e.reasons }

func newUnavailableError(k kind, envVar string, reasons []error) error {
	var b strings.Builder
	fmt.Fprintf(&b, "testenv: no %s server available:\n", k.name)
	for _, r := range reasons {
		fmt.Fprintf(&b, "  - %s\n", indent(r.Error(), "    "))
	}
	b.WriteString("To get one, do any of:\n")
	if envVar != "" {
		fmt.Fprintf(&b, "  - set %s to the URL of a running server, e.g. %s=%s\n", envVar, envVar, k.exampleURL)
	} else {
		fmt.Fprintf(&b, "  - name an environment variable in Options.EnvVar and set it to a server URL, e.g. %s\n", k.exampleURL)
	}
	fmt.Fprintf(&b, "  - start a Docker engine (testcontainers-go will run %s)\n", k.image)
	fmt.Fprintf(&b, "  - install the server locally: apt-get install -y %s", k.aptPackage)
	return &unavailableError{msg: b.String(), reasons: reasons}
}

// indent prefixes every line but the first of s with prefix.
func indent(s, prefix string) string {
	return strings.ReplaceAll(strings.TrimRight(s, "\n"), "\n", "\n"+prefix)
}

// redact hides a password in a URL; other strings are returned unchanged.
func redact(s string) string {
	u, err := url.Parse(s)
	if err != nil || u.Scheme == "" || u.Host == "" {
		return s
	}
	return u.Redacted()
}

// waitReady calls ping until it succeeds, the process behind exited (if not
// nil) ends, ctx is done or readyTimeout passes.
func waitReady(ctx context.Context, exited <-chan struct{}, ping func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, readyTimeout)
	defer cancel()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		attemptCtx, cancelAttempt := context.WithTimeout(ctx, 3*time.Second)
		err := ping(attemptCtx)
		cancelAttempt()
		if err == nil {
			return nil
		}
		select {
		case <-exited:
			return fmt.Errorf("server exited before accepting connections: %w", err)
		case <-ctx.Done():
			return fmt.Errorf("server not ready (waited at most %s): %w; last error: %w", readyTimeout, ctx.Err(), err)
		case <-tick.C:
		}
	}
}
