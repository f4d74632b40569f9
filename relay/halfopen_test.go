package relay_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/internal/connect"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/relaytest"
	"github.com/tedbank/outbox/internal/tcpproxy"
	"github.com/tedbank/outbox/relay"
)

// A link that goes half-open leaves every connection over it silent: the
// LISTEN connection and each idle one of the pool. The watch finds the
// LISTEN connection silent within its timeout (2 s) and reconnects; the
// drain must not then take the pool's silent connections one after the
// other, each for a claim's whole timeout (10 s): a watch or a drain that
// timed out closes the pool's connections, and the next round trip dials a
// fresh one. A claim already waiting on a silent connection still waits out
// its timeout (cutting it short could strand rows the server claimed): one
// timeout at most. The chaos suite's blackhole found events waiting 14 s
// after the link came back.
func TestHalfOpenLinkCostsOneTimeoutAtMost(t *testing.T) {
	f := newFixture(t)
	pool, pcfg, proxy := f.ProxiedPool("half-open-relay")
	fillPool(t, pool)
	cfg := f.RelayConfig("half-open")
	cfg.ListenConfig = pcfg.ConnConfig.Copy()
	r := f.NewRelayWithPool(pool, cfg)
	f.Run(r.Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return r.Stats().ListenUp }, "the relay is not listening")
	f.Settle(1)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return len(f.Entries(f.Stream())) == 1 }, "first TED not published")

	// The link goes silent, its connections open; new connections get
	// through (the link came back at once, or the route changed).
	proxy.Freeze()
	start := time.Now()
	f.Settle(1)
	ctx, cancel := context.WithTimeout(f.Ctx, 30*time.Second)
	defer cancel()
	for len(f.Entries(f.Stream())) < 2 {
		if ctx.Err() != nil {
			t.Fatalf("the TED settled after the link went half-open was not published in 30 s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	took := time.Since(start)
	t.Logf("published %s after the link went half-open", took.Round(time.Millisecond))
	// One claim's timeout at most, with slack for a loaded machine; before,
	// each of the pool's silent connections could cost one in turn (20 s).
	if took > 12*time.Second {
		t.Errorf("published %s after the link went half-open, want within 12 s (one claim timeout, then fresh connections)", took.Round(time.Millisecond))
	}
}

// Every round trip of the relay that gets no answer in time closes the
// pool's connections, not the drain's alone: a lease renewal (partition
// leases, every second), a reap or a takeover that timed out on a silent
// connection leaves the pool's other silent connections behind otherwise,
// and the next claim takes one of them for its whole timeout (10 s). Here
// the LISTEN connection does not go through the link, so that its watch
// (which closes the pool's connections too) does not hide what the other
// round trips do. The chaos suite's blackhole found events waiting 18 s
// after a link came back: renewals and reaps timed out one after the other
// on the connections it had left silent before a claim did.
func TestRoundTripThatTimedOutDropsTheSilentConnections(t *testing.T) {
	for _, ownership := range []string{relay.OwnPartitions, relay.OwnRows} {
		t.Run(ownership, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t)
			// The pool the CLI opens (connect.Postgres: it pings only a
			// connection idle for over a minute), through a proxy.
			pcfg, err := pgx.ParseConfig(f.DBURL)
			if err != nil {
				t.Fatal(err)
			}
			proxy, err := tcpproxy.Start(fmt.Sprintf("%s:%d", pcfg.Host, pcfg.Port))
			if err != nil {
				t.Fatal(err)
			}
			u, err := url.Parse(f.DBURL)
			if err != nil {
				t.Fatal(err)
			}
			u.Host = proxy.Addr()
			pool, err := connect.Postgres(f.Ctx, u.String(), connect.PostgresOptions{AppName: "outbox-silent-" + ownership})
			if err != nil {
				_ = proxy.Close()
				t.Fatal(err)
			}
			relaytest.CloseBehind(t, pool, proxy)
			fillPool(t, pool)
			listen, err := pgx.ParseConfig(f.DBURL)
			if err != nil {
				t.Fatal(err)
			}
			var logs relaytest.SyncBuffer
			cfg := f.RelayConfigOf("silent", ownership)
			cfg.ListenConfig = listen
			cfg.Lease = 2 * time.Second // a reap a second
			cfg.Logger = slog.New(slog.NewTextHandler(io.MultiWriter(&logs, os.Stderr), nil))
			r := f.NewRelayWithPool(pool, cfg)
			sig := relaytest.Signals(r)
			f.Run(r.Run)
			// The start-up drains are over: no claim is in flight when the
			// link goes silent, and nothing wakes the drainer until the TED.
			relaytest.WaitCaughtUp(t, sig, 0)

			proxy.Freeze()
			// The first round trip to time out: a lease renewal, a reap, a
			// takeover's (the relay is idle: no claim is in flight).
			outboxtest.Eventually(t, 20*time.Second, func() bool { return bytes.Contains(logs.Bytes(), []byte("context deadline exceeded")) },
				"no round trip of the relay timed out on the silent link")
			start := time.Now()
			f.Settle(1)
			outboxtest.Eventually(t, 30*time.Second, func() bool { return len(f.Entries(f.Stream())) == 1 },
				"the TED settled after a round trip timed out was not published in 30 s")
			took := time.Since(start)
			t.Logf("published %s after a round trip timed out on the silent link", took.Round(time.Millisecond))
			// A fresh connection's dial and a claim, with slack for a loaded
			// machine; a silent connection costs a claim's timeout (10 s).
			if took > 5*time.Second {
				t.Errorf("published %s after a %s round trip timed out on a silent connection, want within 5 s: "+
					"the pool kept its other silent connections", took.Round(time.Millisecond), ownership)
			}
		})
	}
}

// fillPool opens every connection pool may hold (one statement on each at
// once), so that all of them go through its proxy when the link goes silent.
func fillPool(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	var wg sync.WaitGroup
	for range int(pool.Config().MaxConns) {
		wg.Go(func() {
			if _, err := pool.Exec(t.Context(), "SELECT pg_sleep(0.05)"); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
}
