package relaytest

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"time"

	"github.com/tedbank/outbox/internal/outboxtest"
)

// OutboxCmd runs the real binary (built with fail points) against this
// fixture's servers, with failpoint armed ("" for none).
func (f *Fixture) OutboxCmd(failpoint string, args ...string) *exec.Cmd {
	cmd := exec.Command(outboxtest.Binary(f.T), args...)
	cmd.Env = append(os.Environ(), "DATABASE_URL="+f.DBURL, "REDIS_URL="+f.Redis.URL, "OUTBOX_FAILPOINT="+failpoint)
	return cmd
}

// RunUntilKilled runs cmd and expects the armed fail point to SIGKILL it.
func (f *Fixture) RunUntilKilled(cmd *exec.Cmd) {
	f.T.Helper()
	out, err := RunWithTimeout(cmd, 30*time.Second)
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		f.T.Fatalf("%v: want death by SIGKILL at the fail point, got %v\n%s", cmd.Args, err, out)
	}
}

// RunWithTimeout runs cmd, killing it after d, and returns its output.
func RunWithTimeout(cmd *exec.Cmd, d time.Duration) ([]byte, error) {
	var buf SyncBuffer
	cmd.Stdout, cmd.Stderr = &buf, &buf
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		return buf.Bytes(), err
	case <-time.After(d):
		_ = cmd.Process.Kill()
		<-done
		return buf.Bytes(), fmt.Errorf("still running after %s", d)
	}
}
