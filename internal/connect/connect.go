// Package connect opens the project's PostgreSQL pools and Redis clients with
// the conventions every command shares: an application_name or client name
// starting with "outbox-", a start-up ping with a bounded wait, and errors that
// say what failed and how to fix it without leaking passwords.
package connect

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/redis/go-redis/v9"
	"github.com/tedbank/outbox"
)

// PingTimeout bounds the start-up check of a server.
const PingTimeout = 5 * time.Second

// KeepAlive is the TCP keepalive policy of the PostgreSQL connections: probe
// after 5 s idle, give up after 3 unanswered probes 2 s apart. (The Redis
// clients keep go-redis's own: 30 s idle, 3 probes 5 s apart; their commands
// are bounded by read and write timeouts.)
var KeepAlive = net.KeepAliveConfig{Enable: true, Idle: 5 * time.Second, Interval: 2 * time.Second, Count: 3}

// PostgresOptions tunes Postgres.
type PostgresOptions struct {
	AppName  string // application_name; must start with "outbox-"
	MaxConns int32  // 0 = pgxpool's default
}

// Postgres opens a pool to rawURL and checks that the server answers.
func Postgres(ctx context.Context, rawURL string, opt PostgresOptions) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(rawURL)
	if err != nil {
		return nil, fmt.Errorf("bad PostgreSQL URL %s: %s", Redact(rawURL), redactErr(err, rawURL))
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = opt.AppName
	// Behind a pooler in transaction mode the URL asks for
	// default_query_exec_mode=exec: say what the uuid parameters are.
	cfg.AfterConnect = outbox.RegisterTypes
	if opt.MaxConns > 0 {
		cfg.MaxConns = opt.MaxConns
	}
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = PingTimeout
	}
	// TCP keepalives: an idle connection whose server vanished without a FIN
	// (its machine died, a cut link) is found dead in about 11 s, not Go's
	// default of minutes. (Statements in flight are bounded by the callers'
	// timeouts; the relay's LISTEN connection also sets the server's side:
	// relay/listen.go.)
	dialer := &net.Dialer{Timeout: cfg.ConnConfig.ConnectTimeout, KeepAliveConfig: KeepAlive}
	cfg.ConnConfig.DialFunc = dialer.DialContext
	// The pool pings a connection that sat idle before handing it out; on a
	// half-open connection that ping would otherwise wait for the kernel to
	// give up (minutes).
	cfg.PingTimeout = 2 * time.Second
	// pgxpool pings every connection idle for over a second before handing
	// it out: for a relay polling every few seconds, a second round trip per
	// poll. Ping only connections idle for over a minute; a dead one in
	// between fails its statement, which every caller here retries or reports.
	cfg.ShouldPing = func(_ context.Context, p pgxpool.ShouldPingParams) bool {
		return p.IdleDuration > time.Minute
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("PostgreSQL at %s: %s", Redact(rawURL), redactErr(err, rawURL))
	}
	pctx, cancel := context.WithTimeout(ctx, PingTimeout)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) {
			switch pgErr.Code {
			case "3D000": // invalid_catalog_name
				return nil, fmt.Errorf("PostgreSQL at %s: database %q does not exist (create it, or fix DATABASE_URL or --database-url)",
					Redact(rawURL), cfg.ConnConfig.Database)
			case "28P01", "28000": // invalid_password, invalid_authorization_specification
				return nil, fmt.Errorf("PostgreSQL at %s refused the login of %q: %s (check the user and password in DATABASE_URL)",
					Redact(rawURL), cfg.ConnConfig.User, redactErr(err, rawURL))
			case "57P03", "53300", "57P01", "57P02": // starting up or shutting down, too many connections: try again
				return nil, Unreachable(fmt.Errorf("PostgreSQL at %s is not taking connections yet: %s",
					Redact(rawURL), redactErr(err, rawURL)))
			}
			// The server answered no: waiting will not change its mind.
			return nil, fmt.Errorf("PostgreSQL at %s refused the connection: %s", Redact(rawURL), redactErr(err, rawURL))
		}
		return nil, Unreachable(fmt.Errorf("cannot reach PostgreSQL at %s: %s (is it running? set DATABASE_URL or --database-url)",
			Redact(rawURL), redactErr(err, rawURL)))
	}
	return pool, nil
}

// PostgresConfig parses rawURL into the config of one connection named
// appName (the relay's LISTEN connection), without connecting.
func PostgresConfig(rawURL, appName string) (*pgx.ConnConfig, error) {
	cfg, err := pgx.ParseConfig(rawURL)
	if err != nil {
		return nil, fmt.Errorf("bad PostgreSQL URL %s: %s", Redact(rawURL), redactErr(err, rawURL))
	}
	cfg.RuntimeParams["application_name"] = appName
	if cfg.ConnectTimeout == 0 {
		cfg.ConnectTimeout = PingTimeout
	}
	return cfg, nil
}

// RedisOptions tunes Redis.
type RedisOptions struct {
	ClientName string // CLIENT SETNAME; must start with "outbox-"
	// NoRetries disables go-redis's own retries, which can duplicate a write
	// whose reply was lost; the outbox retries instead.
	NoRetries bool
	PoolSize  int
	// Cluster selects a Redis Cluster client: rawURL is then in go-redis's
	// cluster URL form, redis://host:port?addr=host2:port2&addr=..., any
	// nodes of the cluster (the client discovers the rest).
	Cluster bool
}

// apply sets the options both client kinds share (redis.Options and
// redis.ClusterOptions have the same fields, in different types).
func (opt RedisOptions) apply(clientName *string, contextTimeout *bool, maxRetries, poolSize *int) {
	*clientName = opt.ClientName
	*contextTimeout = true
	if opt.NoRetries {
		*maxRetries = -1
	}
	if opt.PoolSize > 0 {
		*poolSize = opt.PoolSize
	}
}

// Keys returns the keys matching pattern, on every master of a Redis Cluster
// (SCAN walks one node) or on the one server.
func Keys(ctx context.Context, rdb redis.UniversalClient, pattern string) ([]string, error) {
	var (
		mu   sync.Mutex
		keys []string
	)
	scan := func(ctx context.Context, node redis.Cmdable) error {
		iter := node.Scan(ctx, 0, pattern, 1000).Iterator()
		for iter.Next(ctx) {
			mu.Lock()
			keys = append(keys, iter.Val())
			mu.Unlock()
		}
		return iter.Err()
	}
	if cc, ok := rdb.(*redis.ClusterClient); ok {
		err := cc.ForEachMaster(ctx, func(ctx context.Context, node *redis.Client) error { return scan(ctx, node) })
		return keys, err
	}
	return keys, scan(ctx, rdb)
}

// DeleteKeys deletes the keys matching pattern (Keys: on every master of a
// cluster), a pipeline of UNLINKs per thousand: one DEL per round trip takes
// tens of seconds for the hundreds of thousands of keys a benchmark leaves.
func DeleteKeys(ctx context.Context, rdb redis.UniversalClient, pattern string) error {
	keys, err := Keys(ctx, rdb, pattern)
	if err != nil {
		return err
	}
	for len(keys) > 0 {
		chunk := keys[:min(1000, len(keys))]
		keys = keys[len(chunk):]
		_, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for _, k := range chunk {
				p.Unlink(ctx, k)
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("unlink keys %s: %w", pattern, err)
		}
	}
	return nil
}

// RedisClient opens a client to rawURL, a Redis Cluster client when
// opt.Cluster is set, and checks that every master answers.
func RedisClient(ctx context.Context, rawURL string, opt RedisOptions) (redis.UniversalClient, error) {
	if !opt.Cluster {
		return Redis(ctx, rawURL, opt)
	}
	o, err := redis.ParseClusterURL(rawURL)
	if err != nil {
		return nil, fmt.Errorf("bad Redis Cluster URL %s: %s (want redis://host:port?addr=host2:port2&addr=...)",
			Redact(rawURL), redactErr(err, rawURL))
	}
	opt.apply(&o.ClientName, &o.ContextTimeoutEnabled, &o.MaxRetries, &o.PoolSize)
	rdb := redis.NewClusterClient(o)
	pctx, cancel := context.WithTimeout(ctx, PingTimeout)
	defer cancel()
	err = rdb.ForEachMaster(pctx, func(ctx context.Context, c *redis.Client) error { return c.Ping(ctx).Err() })
	if err != nil {
		_ = rdb.Close()
		if answeredNo(err) {
			return nil, fmt.Errorf("the Redis Cluster at %s refused the connection: %s (check REDIS_URL or --redis-url)",
				Redact(rawURL), redactErr(err, rawURL))
		}
		return nil, Unreachable(fmt.Errorf("cannot reach the Redis Cluster at %s: %s (is it running, and is --redis-url in the cluster form? set REDIS_URL or --redis-url)",
			Redact(rawURL), redactErr(err, rawURL)))
	}
	return rdb, nil
}

// Redis opens a client to rawURL and checks that the server answers.
func Redis(ctx context.Context, rawURL string, opt RedisOptions) (*redis.Client, error) {
	o, err := redis.ParseURL(rawURL)
	if err != nil {
		return nil, fmt.Errorf("bad Redis URL %s: %s", Redact(rawURL), redactErr(err, rawURL))
	}
	opt.apply(&o.ClientName, &o.ContextTimeoutEnabled, &o.MaxRetries, &o.PoolSize)
	rdb := redis.NewClient(o)
	pctx, cancel := context.WithTimeout(ctx, PingTimeout)
	defer cancel()
	if err := rdb.Ping(pctx).Err(); err != nil {
		_ = rdb.Close()
		if notReady(err) {
			return nil, Unreachable(fmt.Errorf("Redis at %s is not ready yet: %s", Redact(rawURL), redactErr(err, rawURL)))
		}
		var answered redis.Error
		if errors.As(err, &answered) {
			// The server is up and said no: running is not the question.
			hint := "check REDIS_URL or --redis-url"
			switch msg := err.Error(); {
			case strings.Contains(msg, "DB index is out of range"):
				hint = fmt.Sprintf("database %d does not exist there: the URL's /N must be below the server's 'databases' setting, 16 by default", o.DB)
			case strings.Contains(msg, "WRONGPASS"), strings.Contains(msg, "NOAUTH"), strings.Contains(msg, "NOPERM"):
				hint = "check the user and password in REDIS_URL or --redis-url"
			}
			return nil, fmt.Errorf("Redis at %s refused the connection: %s (%s)", Redact(rawURL), redactErr(err, rawURL), hint)
		}
		return nil, Unreachable(fmt.Errorf("cannot reach Redis at %s: %s (is it running? set REDIS_URL or --redis-url)",
			Redact(rawURL), redactErr(err, rawURL)))
	}
	return rdb, nil
}

// RedisLogs sends go-redis's own log lines (e.g. failed dials, which it
// otherwise prints to stderr) to log at debug level.
func RedisLogs(log *slog.Logger) {
	redis.SetLogger(redisLogger{log})
}

type redisLogger struct{ log *slog.Logger }

func (l redisLogger) Printf(ctx context.Context, format string, v ...any) {
	l.log.DebugContext(ctx, "go-redis: "+fmt.Sprintf(format, v...))
}

// Redact returns rawURL with any password replaced by "xxxxx", whether or
// not it parses (a URL with a bad port is still shown, without its password).
func Redact(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil || u.Scheme == "" {
		return RedactSecrets(rawURL)
	}
	q := u.Query()
	if q.Has("password") {
		q.Set("password", "xxxxx")
		u.RawQuery = q.Encode()
	}
	return RedactSecrets(u.Redacted())
}

// redactErr returns err's text with the URL's password removed, since drivers
// sometimes quote the connection string (or parts of it, decoded).
func redactErr(err error, rawURL string) string {
	return redactText(err.Error(), rawURL)
}

// redactText scrubs the passwords written in rawURL, then any credential
// RedactSecrets recognizes, from msg.
func redactText(msg, rawURL string) string {
	for _, p := range passwordsIn(rawURL) {
		msg = strings.ReplaceAll(msg, p, "xxxxx")
	}
	return RedactSecrets(msg)
}

var unescape = url.PathUnescape

// ClosePool closes pool, waiting at most d: a connection stuck on a half-open
// socket can hold pgxpool's Close for a minute, and a process that was told
// to stop must not. The process exits soon after, which frees the rest.
func ClosePool(pool *pgxpool.Pool, d time.Duration) {
	done := make(chan struct{})
	go func() {
		pool.Close()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(d):
	}
}

// ErrUnreachable: a server did not answer (not running yet, restarting, a
// network in between down), as opposed to one that answered no (a bad
// password, a missing database). Errors.Is finds it in the errors of
// Postgres, Redis and RedisClient; a process starting may wait and try
// again.
var ErrUnreachable = errors.New("server unreachable")

// Unreachable marks err as ErrUnreachable, its message unchanged (for the
// connection errors of other clients: NATS's).
func Unreachable(err error) error { return unreachableError{err} }

type unreachableError struct{ err error }

func (u unreachableError) Error() string        { return u.err.Error() }
func (u unreachableError) Unwrap() error        { return u.err }
func (u unreachableError) Is(target error) bool { return target == ErrUnreachable }

// notReady: Redis answered that it cannot serve yet (loading its data,
// busy with a script, no master, a cluster reconfiguring): it will.
func notReady(err error) bool {
	for _, prefix := range []string{"LOADING", "BUSY", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN"} {
		if redis.HasErrorPrefix(err, prefix) {
			return true
		}
	}
	return false
}

// answeredNo: Redis answered, and not with "not yet" (a bad password, a
// missing database, a refused command).
func answeredNo(err error) bool {
	var answered redis.Error
	return errors.As(err, &answered) && !notReady(err)
}
