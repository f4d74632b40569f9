package relaytest

import (
	"context"
	"errors"
	"math/rand/v2"
	"net"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/tcpproxy"
)

// StallingRedis publishes for real, then blocks until Release is closed: a
// relay that stalls (GC pause, network) after XADD and before its mark.
// Published is closed when the first pipeline has run.
type StallingRedis struct {
	*redis.Client
	Published chan struct{}
	Release   chan struct{}
}

// NewStallingRedis returns a StallingRedis on c.
func NewStallingRedis(c *redis.Client) *StallingRedis {
	return &StallingRedis{Client: c, Published: make(chan struct{}), Release: make(chan struct{})}
}

// Pipelined runs fn, signals Published and waits for Release.
func (s *StallingRedis) Pipelined(ctx context.Context, fn func(redis.Pipeliner) error) ([]redis.Cmder, error) {
	cmds, err := s.Client.Pipelined(ctx, fn)
	close(s.Published)
	<-s.Release
	return cmds, err
}

// CountingRedis records every event id it publishes.
type CountingRedis struct {
	*redis.Client
	mu   sync.Mutex
	seen map[string]int
}

// NewCountingRedis returns a CountingRedis on c.
func NewCountingRedis(c *redis.Client) *CountingRedis {
	return &CountingRedis{Client: c, seen: map[string]int{}}
}

// Pipelined runs fn, counting its XADDs.
func (c *CountingRedis) Pipelined(ctx context.Context, fn func(redis.Pipeliner) error) ([]redis.Cmder, error) {
	return c.Client.Pipelined(ctx, func(p redis.Pipeliner) error {
		return fn(countingPipe{Pipeliner: p, c: c})
	})
}

// Seen returns how often each event id was published.
func (c *CountingRedis) Seen() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]int, len(c.seen))
	for k, v := range c.seen {
		out[k] = v
	}
	return out
}

type countingPipe struct {
	redis.Pipeliner
	c *CountingRedis
}

func (p countingPipe) XAdd(ctx context.Context, a *redis.XAddArgs) *redis.StringCmd {
	p.c.mu.Lock()
	p.c.seen[a.Values.([]any)[1].(string)]++
	p.c.mu.Unlock()
	return p.Pipeliner.XAdd(ctx, a)
}

// FlakyRedis fails a share of XADDs (as a per-event error) and delays the
// others a little, to shake the interleaving of relays.
type FlakyRedis struct {
	*redis.Client
	FailRate float64
}

// Pipelined runs fn, failing FailRate of its XADDs.
func (c *FlakyRedis) Pipelined(ctx context.Context, fn func(redis.Pipeliner) error) ([]redis.Cmder, error) {
	time.Sleep(time.Duration(rand.IntN(3)) * time.Millisecond)
	return c.Client.Pipelined(ctx, func(p redis.Pipeliner) error {
		return fn(flakyPipe{Pipeliner: p, failRate: c.FailRate})
	})
}

type flakyPipe struct {
	redis.Pipeliner
	failRate float64
}

func (p flakyPipe) XAdd(ctx context.Context, a *redis.XAddArgs) *redis.StringCmd {
	if rand.Float64() < p.failRate {
		return redis.NewStringResult("", errors.New("ERR injected failure"))
	}
	return p.Pipeliner.XAdd(ctx, a)
}

// SyncBuffer is a bytes buffer safe for concurrent writers (a logger and a
// reader, a process's stdout and stderr).
type SyncBuffer struct {
	mu sync.Mutex
	b  []byte
}

func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.b = append(s.b, p...)
	return len(p), nil
}

// Bytes returns a copy of what was written.
func (s *SyncBuffer) Bytes() []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.b)
}

// ViaProxy points cfg at the proxy, and every fallback pgx derived from the
// URL too: with sslmode=prefer (the default) a connection that fails is
// retried in plain text at the fallback's address, through which a new
// connection would bypass a proxy that is down.
func ViaProxy(cfg *pgconn.Config, p *tcpproxy.Proxy) {
	cfg.Host, cfg.Port = "127.0.0.1", uint16(p.Port())
	for _, fb := range cfg.Fallbacks {
		fb.Host, fb.Port = cfg.Host, cfg.Port
	}
}

// FreeAddr returns a loopback address with a port free right now.
func FreeAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}
