package relay_test

import (
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/relaytest"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/relay/redisbroker"
)

// Failover (sql/migrations/0012_relay_liveness.sql): the relays take over a
// relay's work the moment the database sees its LISTEN backend gone. The
// process kills are in failover_test.go at the module root; these tests cut
// the connections themselves.

// takeoverBound: the relays look four times a second; the rest is slack for
// a loaded machine. Leases are 30 s and polls ten minutes: a test passing
// within it proves the takeover.
const takeoverBound = 5 * time.Second

// A relay that told writers it is busy and died (its LISTEN backend, holding
// the ownership lock, is gone): writers would stay silent and a sleeping
// relay wait for its poll. The live relay says "sleep" for it.
func TestBusyWordOfADeadRelayIsTakenBack(t *testing.T) {
	f := newFixture(t)
	b := f.NewRelay(f.RelayConfig("relay-b"), nil)
	sig := relaytest.Signals(b)
	f.Run(b.Run)
	relaytest.WaitCaughtUp(t, sig, 0) // its start-up drains are over: it sleeps
	if got := f.IdleFlag(); got != 1 {
		t.Fatalf("relay-b caught up with the idle flag at %d: writers not told to notify", got)
	}

	// The dead relay: its LISTEN connection held the lock of its ownership
	// and said "busy" as itself; then the connection closed.
	mode := 1
	if b.Ownership() == relay.OwnPartitions {
		mode = 2
	}
	conn, err := pgx.Connect(f.Ctx, f.DBURL)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(f.Ctx, "SELECT pg_advisory_lock_shared(1869903216, $1)", mode); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(f.Ctx, "SELECT outbox_relay_busy(pg_backend_pid())"); err != nil {
		t.Fatal(err)
	}
	if f.IdleFlag() != 0 {
		t.Fatal("the flag does not say busy")
	}
	if err := conn.Close(f.Ctx); err != nil {
		t.Fatal(err)
	}
	f.Settle(1)
	outboxtest.Eventually(t, takeoverBound, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 1
	}, "the event waited: writers stayed silent after the busy relay died (idle flag %d)", f.IdleFlag())
	if f.IdleFlag() != 1 {
		t.Fatal("writers were not told to notify again")
	}
	// And the next commit is announced as usual.
	f.Settle(1)
	outboxtest.Eventually(t, takeoverBound, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 2
	}, "the second event waited")
}

// A relay whose LISTEN backend is terminated while it is alive, holding a
// published batch it has not marked: the other relay takes the claim over
// at once and publishes it; the first relay's late mark is fenced.
func TestClaimOfARelayWhoseListenBackendWentIsTakenOverAndFenced(t *testing.T) {
	f := newFixture(t)
	teds := f.Settle(10)
	stall := relaytest.NewStallingRedis(f.Redis.Client)
	// relay-a's dials fail while its LISTEN connection is cut: a relay that
	// reconnects within the watch's quarter second restamps its claims and
	// keeps them (it is alive), which is not the case under test.
	var cutOff atomic.Bool
	cfg, err := pgxpool.ParseConfig(f.DBURL)
	if err != nil {
		t.Fatal(err)
	}
	dialer := &net.Dialer{Timeout: 2 * time.Second}
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		if cutOff.Load() {
			return nil, errors.New("relay-a is cut off")
		}
		return dialer.DialContext(ctx, network, addr)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = "relay-a"
	poolA, err := pgxpool.NewWithConfig(f.Ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(poolA.Close)
	a, err := relay.New(poolA, f.RedisBroker(stall, redisbroker.Config{}), f.RowsRelayConfig("relay-a"))
	if err != nil {
		t.Fatal(err)
	}
	stopA := f.Run(a.Run)
	release := sync.OnceFunc(func() { close(stall.Release) })
	t.Cleanup(release)
	<-stall.Published // relay-a claimed and published, and is stuck before its mark

	b := f.NewRelay(f.RowsRelayConfig("relay-b"), nil)
	f.Run(b.Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return b.Stats().ListenUp }, "relay-b not listening")
	cutOff.Store(true)
	f.Exec("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'relay-a-listen'")
	cut := time.Now()
	outboxtest.Eventually(t, takeoverBound, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == len(teds)
	}, "relay-a's claim was not taken over")
	t.Logf("taken over %s after relay-a's LISTEN backend went", time.Since(cut).Round(time.Millisecond))
	cutOff.Store(false)

	go stopA()
	release()
	outboxtest.Eventually(t, 15*time.Second, func() bool { return a.Stats().Fenced == int64(len(teds)) },
		"relay-a's late mark was not fenced: %+v", a.Stats())
	if got := len(f.Entries(f.Stream())); got != 2*len(teds) {
		t.Fatalf("stream holds %d entries, want %d (each event from both relays)", got, 2*len(teds))
	}
}

// A relay whose link to the database goes half-open (every packet dropped,
// nothing closed: a dead machine or a cut cable): the server's TCP keepalives,
// which the relay sets on its LISTEN connection, end its backend within a few
// seconds, and the other relay takes its claim over then, long before the
// 30 s lease.
func TestHalfOpenRelayIsTakenOverWhenTheServerGivesUp(t *testing.T) {
	f := newFixture(t)
	const ip = "127.0.0.77" // relay-a's own loopback address: only its packets are dropped
	teds := f.Settle(10)
	cfg, err := pgxpool.ParseConfig(f.DBURL)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.ConnConfig.Host == "" || cfg.ConnConfig.Host[0] == '/' {
		t.Fatalf("the test database is reached over a Unix socket (%q): a half-open link needs TCP", cfg.ConnConfig.Host)
	}
	dialer := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}, Timeout: 2 * time.Second}
	cfg.ConnConfig.DialFunc = dialer.DialContext
	cfg.ConnConfig.RuntimeParams["application_name"] = "relay-a"
	poolA, err := pgxpool.NewWithConfig(f.Ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(poolA.Close)
	if err := poolA.Ping(f.Ctx); err != nil {
		msg := "the test database does not take clients from " + ip + ": " + err.Error()
		if os.Getenv("OUTBOX_TEST_REQUIRE_IPTABLES") != "" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	stall := relaytest.NewStallingRedis(f.Redis.Client)
	a, err := relay.New(poolA, f.RedisBroker(stall, redisbroker.Config{}), f.RowsRelayConfig("relay-a"))
	if err != nil {
		t.Fatal(err)
	}
	f.Run(a.Run)
	t.Cleanup(func() { close(stall.Release) })
	select { // relay-a claimed and published, and is stuck before its mark
	case <-stall.Published:
	case <-time.After(10 * time.Second):
		t.Fatal("relay-a did not publish")
	}
	outboxtest.Eventually(t, 10*time.Second, func() bool { return a.Stats().ListenUp }, "relay-a not listening")

	b := f.NewRelay(f.RowsRelayConfig("relay-b"), nil)
	f.Run(b.Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return b.Stats().ListenUp }, "relay-b not listening")
	blackhole(t, ip)
	cut := time.Now()
	outboxtest.Eventually(t, 15*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == len(teds)
	}, "relay-a's claim was not taken over within 15s of its link going half-open (lease 30s)")
	t.Logf("taken over %s after relay-a's link went half-open", time.Since(cut).Round(time.Millisecond))
}

// blackhole drops every packet from and to ip until the test ends
// (iptables; root). Without iptables the test is skipped, unless
// OUTBOX_TEST_REQUIRE_IPTABLES is set (CI sets it: there the test must run).
func blackhole(t *testing.T, ip string) {
	t.Helper()
	rules := [][]string{{"OUTPUT", "-s", ip, "-j", "DROP"}, {"OUTPUT", "-d", ip, "-j", "DROP"}}
	for _, r := range rules {
		out, err := exec.Command("iptables", append([]string{"-I"}, r...)...).CombinedOutput()
		if err != nil {
			msg := "iptables cannot drop packets here (" + err.Error() + ": " + string(out) + "); a half-open link needs it"
			if os.Getenv("OUTBOX_TEST_REQUIRE_IPTABLES") != "" {
				t.Fatal(msg)
			}
			t.Skip(msg)
		}
		t.Cleanup(func() {
			if out, err := exec.Command("iptables", append([]string{"-D"}, r...)...).CombinedOutput(); err != nil {
				t.Errorf("removing the iptables rule %v: %v %s", r, err, out)
			}
		})
	}
}
