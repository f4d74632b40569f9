package cli

import (
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/relaytest"
	"github.com/tedbank/outbox/internal/tcpproxy"
)

// proxied returns rawURL with its host:port replaced by a proxy's, and the
// proxy (closed when the test ends).
func proxied(t *testing.T, rawURL string) (string, *tcpproxy.Proxy) {
	t.Helper()
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	p, err := tcpproxy.Start(u.Host)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	u.Host = p.Addr()
	return u.String(), p
}

// background runs a command in this process with vars until stop is
// called, which returns its exit code.
func background(vars map[string]string, args ...string) (out *relaytest.SyncBuffer, stop func() int) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	out = new(relaytest.SyncBuffer)
	e := &env{stdout: out, stderr: out, getenv: func(k string) string { return vars[k] }}
	go func() { done <- e.main(ctx, args) }()
	return out, func() int { cancel(); return <-done }
}

// A relay and a consumer started while PostgreSQL and Redis do not answer
// wait for them, say so, and deliver once they do; one told to stop while
// it waits exits 0; the wait is bounded (--wait-for-servers).
func TestRelayAndConsumerStartedBeforeTheirServersWaitForThem(t *testing.T) {
	t.Parallel()
	d := newDeployment(t)
	pgURL, pg := proxied(t, d.env["DATABASE_URL"])
	redisURL, rds := proxied(t, d.env["REDIS_URL"])
	pg.Down()
	rds.Down()
	down := map[string]string{"DATABASE_URL": pgURL, "REDIS_URL": redisURL}

	relayOut, stopRelay := background(down, "relay", "--stream-prefix", d.rdb.Prefix+"outbox.event.", "--name", "r1")
	fraudOut, stopFraud := background(down, "fraud", "--stream", d.stream(), "--key-prefix", d.keyPrefix(), "--consumer", "c1")
	for name, out := range map[string]*relaytest.SyncBuffer{"relay": relayOut, "fraud": fraudOut} {
		outboxtest.Eventually(t, 10*time.Second, func() bool {
			return strings.Contains(string(out.Bytes()), "a server does not answer; waiting for it")
		}, "%s did not say it waits:\n%s", name, out.Bytes())
	}
	if code, _, stderr := run(t, d.env, "settle", "--count", "10", "--json"); code != exitOK {
		t.Fatalf("settle: exit %d %s", code, stderr)
	}
	pg.Up()
	rds.Up()
	outboxtest.Eventually(t, 30*time.Second, func() bool {
		code, st := d.status("--stream", d.stream(), "--key-prefix", d.keyPrefix())
		return code == exitOK && st.Published == 10 && st.GroupLag == 0 && st.GroupPending == 0 && st.LiveMembers == 1
	}, "the relay and the consumer did not start and deliver once their servers answered:\n%s\n%s", relayOut.Bytes(), fraudOut.Bytes())
	if code := stopRelay(); code != exitOK {
		t.Errorf("relay: exit %d\n%s", code, relayOut.Bytes())
	}
	if code := stopFraud(); code != exitOK {
		t.Errorf("fraud: exit %d\n%s", code, fraudOut.Bytes())
	}

	// Told to stop while it waits: exit 0.
	pg.Down()
	out, stop := background(down, "relay", "--stream-prefix", d.rdb.Prefix+"outbox.event.")
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return strings.Contains(string(out.Bytes()), "waiting for it")
	}, "the relay did not wait:\n%s", out.Bytes())
	if code := stop(); code != exitOK {
		t.Errorf("a relay stopped while it waits: exit %d\n%s", code, out.Bytes())
	}

	// The wait ends: exit 1, with the server's error and how long it waited.
	start := time.Now()
	code, _, stderr := run(t, down, "relay", "--stream-prefix", d.rdb.Prefix+"outbox.event.", "--wait-for-servers", "1s")
	lines := strings.Split(strings.TrimSpace(stderr), "\n")
	if last := lines[len(lines)-1]; code != exitFailure || !strings.Contains(last, "cannot reach PostgreSQL") ||
		!strings.Contains(last, "waited 1s for it: --wait-for-servers") || time.Since(start) < time.Second {
		t.Fatalf("exit %d after %s, stderr:\n%s", code, time.Since(start), stderr)
	}
}
