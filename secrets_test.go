package outbox_test

import (
	"context"
	"net/url"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/relaytest"
)

// Passwords in the URLs work (a PostgreSQL login role, a Redis ACL user
// limited to the test's keys) and never appear in logs, errors or status
// output, at debug level included.
func TestSecretsNeverLeakAndAuthUsersWork(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	pgPass, redisPass := "pg-S3cret-"+uuid.NewString()[:8], "redis-S3cret-"+uuid.NewString()[:8]
	pgUser, redisUser := "t_"+strings.ReplaceAll(uuid.NewString()[:12], "-", ""), "t-"+uuid.NewString()[:8]

	if _, err := f.Pool.Exec(ctx, "CREATE ROLE "+pgUser+" LOGIN SUPERUSER PASSWORD '"+pgPass+"'"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = f.Pool.Exec(context.Background(), "DROP ROLE IF EXISTS "+pgUser) })
	if err := f.Redis.Do(ctx, "ACL", "SETUSER", redisUser, "on", ">"+redisPass, "~"+f.Redis.Prefix+"*", "+@all").Err(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Redis.Do(context.Background(), "ACL", "DELUSER", redisUser) })

	pgURL, _ := url.Parse(f.DBURL)
	pgURL.User = url.UserPassword(pgUser, pgPass)
	rURL, _ := url.Parse(f.Redis.URL)
	rURL.User = url.UserPassword(redisUser, redisPass)
	env := func(db, rd string) []string {
		return append(os.Environ(), "DATABASE_URL="+db, "REDIS_URL="+rd, "OUTBOX_LOG_LEVEL=debug")
	}
	leaks := func(what string, out []byte) {
		t.Helper()
		for _, secret := range []string{pgPass, redisPass} {
			if strings.Contains(string(out), secret) {
				t.Errorf("%s leaks a password:\n%s", what, out)
			}
		}
	}

	// Working credentials: relay and consumer run, publish and process.
	relayCmd := f.OutboxCmd("", "relay", "--stream-prefix", f.StreamPrefix())
	relayCmd.Env = env(pgURL.String(), rURL.String())
	var relayOut relaytest.SyncBuffer
	relayCmd.Stdout, relayCmd.Stderr = &relayOut, &relayOut
	if err := relayCmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = relayCmd.Process.Kill() })
	teds := f.Settle(5)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 5
	}, "relay with password credentials did not publish")
	fraudCmd := f.OutboxCmd("", "fraud", "--stream", f.Stream(), "--key-prefix", f.keyPrefix(), "--consumer", "c1")
	fraudCmd.Env = env(pgURL.String(), rURL.String())
	var fraudOut relaytest.SyncBuffer
	fraudCmd.Stdout, fraudCmd.Stderr = &fraudOut, &fraudOut
	if err := fraudCmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = fraudCmd.Process.Kill() })
	outboxtest.Eventually(t, 10*time.Second, func() bool { return f.report().Verdicts == 5 }, "consumer with an ACL user did not process")
	f.checkEffectsOnce(teds)

	status := f.OutboxCmd("", "status", "--json", "--stream", f.Stream(), "--key-prefix", f.keyPrefix())
	status.Env = env(pgURL.String(), rURL.String())
	out, err := status.CombinedOutput()
	if err != nil {
		t.Fatalf("status: %v\n%s", err, out)
	}
	leaks("status", out)

	// Wrong credentials: one line that names the server, not the password.
	badPG := *pgURL
	badPG.User = url.UserPassword(pgUser, pgPass+"-wrong")
	badRedis := *rURL
	badRedis.User = url.UserPassword(redisUser, redisPass+"-wrong")
	for _, c := range []struct{ name, db, rd string }{{"bad postgres", badPG.String(), rURL.String()}, {"bad redis", pgURL.String(), badRedis.String()}} {
		cmd := f.OutboxCmd("", "status")
		cmd.Env = env(c.db, c.rd)
		out, err := cmd.CombinedOutput()
		if err == nil {
			t.Fatalf("%s: status succeeded", c.name)
		}
		leaks(c.name, out)
		if strings.Contains(string(out), "-wrong") {
			t.Errorf("%s: the wrong password appears in %s", c.name, out)
		}
	}

	for _, c := range []struct {
		name string
		cmd  interface{ Signal(os.Signal) error }
		out  *relaytest.SyncBuffer
	}{{"relay log", relayCmd.Process, &relayOut}, {"fraud log", fraudCmd.Process, &fraudOut}} {
		_ = c.cmd.Signal(syscall.SIGTERM)
		time.Sleep(100 * time.Millisecond)
		leaks(c.name, c.out.Bytes())
	}
	if len(relayOut.Bytes()) == 0 {
		t.Fatal("no relay log captured; the leak check saw nothing")
	}
}
