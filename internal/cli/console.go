package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/connect"
	"github.com/tedbank/outbox/internal/console"
	"github.com/tedbank/outbox/internal/status"
)

// defaultConsoleAddr: the console binds to the loopback interface unless
// told otherwise.
const defaultConsoleAddr = "127.0.0.1:9480"

func runConsole(ctx context.Context, e *env, args []string) error {
	var c common
	fs := e.flags("console", &c)
	addr := fs.String("addr", defaultConsoleAddr, "where to serve the console; an address that is not loopback needs --token")
	token := fs.String("token", e.getenv("OUTBOX_CONSOLE_TOKEN"), "a secret every request must carry (open the page as http://<addr>/#token=<token>) (env OUTBOX_CONSOLE_TOKEN)")
	broker, options := statusFlags(e, fs)
	if err := e.parse(fs, args); err != nil {
		return err
	}
	opts, err := options()
	if err != nil {
		return err
	}
	log, err := c.logger(e.stderr)
	if err != nil {
		return err
	}
	host, _, err := net.SplitHostPort(*addr)
	if err != nil {
		return usagef("--addr %q: want host:port, e.g. %s", *addr, defaultConsoleAddr)
	}
	loopback := host == "localhost" || net.ParseIP(host) != nil && net.ParseIP(host).IsLoopback()
	if !loopback && *token == "" {
		return usagef("--addr %s is reachable from other machines: give --token (or OUTBOX_CONSOLE_TOKEN), or bind to 127.0.0.1", *addr)
	}
	if !isSet(fs, "samples") {
		opts.Samples = 20 // a page has room for more than a terminal
	}
	// Every 2 s per open page: read what the backlog costs, not the table.
	opts.Light = true
	srv := &consoleServers{c: &c, broker: broker, log: log}
	defer srv.close()
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		return fmt.Errorf("serve the console: %w", err)
	}
	h := console.Handler(console.Config{Status: opts, Open: srv.open, Token: *token, Loopback: loopback, Logger: log})
	hs := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	url := "http://" + ln.Addr().String() + "/"
	if *token != "" {
		url += "#token=<token>"
	}
	fmt.Fprintf(e.stdout, "console on %s (stop it with Ctrl-C)\n", url)
	log.Info("serving the console", slog.String("addr", ln.Addr().String()), slog.Bool("token", *token != ""))
	done := make(chan error, 1)
	go func() { done <- hs.Serve(ln) }()
	select {
	case err := <-done:
		return fmt.Errorf("serve the console: %w", err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 3*time.Second)
	defer cancel()
	if err := hs.Shutdown(sctx); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// consoleServers keeps the console's connections, opening again on the next
// request a side that could not be opened (the console outlives an outage).
type consoleServers struct {
	c      *common
	broker *brokerChoice
	log    *slog.Logger

	mu   sync.Mutex
	pool *pgxpool.Pool
	rdb  redis.UniversalClient
	nc   *nats.Conn
	js   jetstream.JetStream
}

func (s *consoleServers) open(ctx context.Context) status.Servers {
	s.mu.Lock()
	defer s.mu.Unlock()
	var srv status.Servers
	// Each assigned only when it opened: a failed open returns a nil
	// pointer, which would make a non-nil interface.
	if s.pool == nil {
		pool, err := openOutbox(ctx, s.c.databaseURL, connect.PostgresOptions{AppName: "outbox-console", MaxConns: 4})
		if srv.PostgresErr = err; err == nil {
			s.pool = pool
		}
	}
	if s.rdb == nil {
		rdb, err := s.c.redis(ctx, connect.RedisOptions{ClientName: "outbox-console"})
		if srv.RedisErr = err; err == nil {
			s.rdb = rdb
		}
	}
	if s.broker.nats() && s.nc == nil {
		nc, js, err := s.broker.connect("outbox-console")
		if srv.NATSErr = err; err == nil {
			s.nc, s.js = nc, js
		}
	}
	if s.pool != nil {
		srv.Postgres = s.pool
	}
	if s.rdb != nil {
		srv.Redis = s.rdb
	}
	srv.JetStream = s.js
	return srv
}

func (s *consoleServers) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pool != nil {
		s.pool.Close()
	}
	if s.rdb != nil {
		_ = s.rdb.Close()
	}
	if s.nc != nil {
		s.nc.Close()
	}
}
