package testenv

import (
	"context"
	"errors"
	"net"
	"net/url"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// dialable reports whether something accepts TCP connections at the URL's
// host:port.
func dialable(t *testing.T, rawURL string) bool {
	t.Helper()
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.DialTimeout("tcp", u.Host, time.Second)
	if err != nil {
		return false
	}
	defer c.Close()
	// A port of the ephemeral range with nothing listening on it can still
	// take a connection: the kernel may give the dial that very port as its
	// own, and the connection meets itself (TCP's simultaneous open). A
	// .ci/run saw a killed server's port "dialable" so.
	return c.LocalAddr().String() != c.RemoteAddr().String()
}

func TestLocalPostgresStopStartKeepsDataAndPort(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	opt := testOptions(t)
	opt.ExtraArgs = []string{"-c", "synchronous_commit=on"}
	s, err := LocalPostgres(ctx, opt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	if !s.Running() || s.Pid() == 0 {
		t.Fatalf("Running() = %v, Pid() = %d right after start", s.Running(), s.Pid())
	}
	conn := connectPostgres(t, ctx, s.URL)
	if _, err := conn.Exec(ctx, "CREATE TABLE kept (v int); INSERT INTO kept VALUES (42)"); err != nil {
		t.Fatal(err)
	}
	_ = conn.Close(ctx)

	for _, stop := range []struct {
		name string
		do   func() error
	}{
		{"Stop", s.Stop},
		{"StopWith(SIGQUIT)", func() error { return s.StopWith(syscall.SIGQUIT) }},
		{"Kill", s.Kill},
	} {
		if err := stop.do(); err != nil {
			t.Fatalf("%s: %v", stop.name, err)
		}
		if s.Running() || s.Pid() != 0 || dialable(t, s.URL) {
			t.Fatalf("after %s: Running() = %v, Pid() = %d, dialable = %v", stop.name, s.Running(), s.Pid(), dialable(t, s.URL))
		}
		if err := s.Start(ctx); err != nil {
			t.Fatalf("Start after %s: %v", stop.name, err)
		}
		conn := connectPostgres(t, ctx, s.URL)
		var v int
		if err := conn.QueryRow(ctx, "SELECT v FROM kept").Scan(&v); err != nil || v != 42 {
			t.Fatalf("after %s and Start: v = %d, err %v; want 42", stop.name, v, err)
		}
		_ = conn.Close(ctx)
	}
	if err := s.Start(ctx); err != nil {
		t.Errorf("Start of a running server: %v", err)
	}
	log, err := os.ReadFile(s.LogPath())
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(log), "--- testenv: restarting postgres"); n != 3 {
		t.Errorf("log has %d restart markers, want 3 (the log is appended to, not truncated)", n)
	}
	dir := s.Dir()
	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	assertStopped(t, s.URL, dir)
	if err := s.Start(ctx); err == nil {
		t.Error("Start after Close succeeded")
	}
}

func TestLocalRedisKillStartKeepsAppendOnlyData(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	opt := testOptions(t)
	opt.ExtraArgs = []string{"--appendonly", "yes", "--appendfsync", "always"}
	s, err := LocalRedis(ctx, opt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	o, err := redis.ParseURL(s.URL)
	if err != nil {
		t.Fatal(err)
	}
	c := redis.NewClient(o)
	defer c.Close()
	id, err := c.XAdd(ctx, &redis.XAddArgs{Stream: "s", Values: []any{"k", "v"}}).Result()
	if err != nil {
		t.Fatal(err)
	}
	pid := s.Pid()
	if err := s.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Fatalf("redis-server %d still exists after Kill (kill -0: %v)", pid, err)
	}
	if err := s.Start(ctx); err != nil {
		t.Fatal(err)
	}
	msgs, err := c.XRange(ctx, "s", "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(msgs) != 1 || msgs[0].ID != id {
		t.Fatalf("after SIGKILL and restart the stream holds %v, want the acknowledged entry %s", msgs, id)
	}
}

func TestStopStartOfANonLocalServer(t *testing.T) {
	s := &Server{URL: "redis://127.0.0.1:1/0", Source: sourceEnv}
	for name, err := range map[string]error{
		"Stop": s.Stop(), "Kill": s.Kill(), "StopWith": s.StopWith(syscall.SIGTERM), "Start": s.Start(context.Background()),
	} {
		if !errors.Is(err, ErrNotLocal) {
			t.Errorf("%s of an env server: %v, want ErrNotLocal", name, err)
		}
	}
	if s.Running() || s.Pid() != 0 || s.LogPath() != "" || s.Dir() != "" {
		t.Errorf("env server: Running %v Pid %d LogPath %q Dir %q", s.Running(), s.Pid(), s.LogPath(), s.Dir())
	}
}
