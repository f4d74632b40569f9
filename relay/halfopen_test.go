package relay_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/tedbank/outbox/internal/outboxtest"
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
	// Fill the pool: every connection it holds goes through the proxy.
	var wg sync.WaitGroup
	for range int(pcfg.MaxConns) {
		wg.Go(func() {
			if _, err := pool.Exec(f.Ctx, "SELECT pg_sleep(0.05)"); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
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
