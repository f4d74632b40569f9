package chaos

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tedbank/outbox/internal/tcpproxy"
	"github.com/tedbank/outbox/internal/testenv"
)

// TestRelayAfterHalfOpenPostgres isolates what the suite found: after the
// relay's PostgreSQL connections were blackholed for four seconds, does the
// relay still reap expired claims, and does it exit promptly on SIGTERM?
// `make chaos` runs it; alone:
//
//	go test ./internal/chaos -chaos -run TestRelayAfterHalfOpenPostgres -v
func TestRelayAfterHalfOpenPostgres(t *testing.T) {
	if !*enabled {
		t.Skip("run with -chaos")
	}
	ctx := t.Context()
	dir := t.TempDir()
	bin := *binary
	if bin == "" {
		bin = filepath.Join(dir, "outbox")
		if out, err := exec.Command("go", "build", "-tags", "failpoint", "-o", bin, "github.com/tedbank/outbox/cmd/outbox").CombinedOutput(); err != nil {
			t.Fatalf("go build: %v\n%s", err, out)
		}
	}
	pg, err := testenv.LocalPostgres(ctx, testenv.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer pg.Close()
	rds, err := testenv.LocalRedis(ctx, testenv.Options{ExtraArgs: DefaultRedisArgs})
	if err != nil {
		t.Fatal(err)
	}
	defer rds.Close()
	if out, err := exec.Command(bin, "migrate", "--database-url", pg.URL).CombinedOutput(); err != nil {
		t.Fatalf("migrate: %v\n%s", err, out)
	}
	px, err := tcpproxy.Start(hostPort(pg.URL))
	if err != nil {
		t.Fatal(err)
	}
	defer px.Close()
	logPath := filepath.Join(dir, "relay.log")
	log, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	cmd := exec.Command(bin, append([]string{"relay", "--name", "r1", "--ownership", "rows", // the row claimer's reaper
		"--database-url", strings.Replace(pg.URL, hostPort(pg.URL), px.Addr(), 1), "--redis-url", rds.URL}, relayArgs...)...)
	cmd.Env = cleanEnv()
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	defer func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		b, _ := os.ReadFile(logPath)
		t.Logf("relay log:\n%s", b)
	}()
	time.Sleep(3 * time.Second)

	// Blackhole every connection of the relay to PostgreSQL for 4s.
	for end := time.Now().Add(4 * time.Second); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		px.Freeze()
	}
	time.Sleep(2 * time.Second)

	// A claim abandoned by another relay a minute ago: with a 5s lease the
	// reaper (every 2.5s) must return it to pending and the relay publish it.
	conn, err := pgx.Connect(ctx, pg.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var id string
	if err := conn.QueryRow(ctx, `INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, status, claimed_at, claimed_by, claim_token)
		VALUES ('probe', 'p-1', 'probe.abandoned', '{}', 'publishing', now() - interval '1 minute', 'gone', gen_random_uuid()) RETURNING id::text`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	var status string
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		if err := conn.QueryRow(ctx, "SELECT status FROM outbox_messages WHERE id = $1", id).Scan(&status); err != nil {
			t.Fatal(err)
		}
		if status == "published" {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if status != "published" {
		t.Errorf("an expired claim is still %q 20s after it was inserted: the relay's reaper is stuck on a half-open connection", status)
	}

	start := time.Now()
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-done:
		if took := time.Since(start); err != nil || took > 5*time.Second {
			t.Errorf("relay exited %v %s after SIGTERM, want status 0 within 5s", err, took.Round(time.Millisecond))
		}
	case <-time.After(termGrace):
		_ = cmd.Process.Signal(syscall.SIGQUIT) // goroutine dump into the log
		<-done
		t.Errorf("relay still running %s after SIGTERM (goroutine dump in the log)", termGrace)
	}
}
