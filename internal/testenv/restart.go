package testenv

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"
)

// ErrNotLocal is returned by the stop and start methods of a Server that was
// not started from local binaries by this process (one from the environment
// or from Docker).
var ErrNotLocal = errors.New("testenv: not a local server started by this process")

// localProc is the restartable process behind a local Server: it remembers
// how the server was started, so that it can be stopped and started again on
// the same port with the same data directory.
type localProc struct {
	mu     sync.Mutex
	srv    server
	port   int
	url    string
	opt    Options
	proc   *process // nil while stopped
	closed bool
}

// close stops the process for good (Close), as before restarts existed.
func (l *localProc) close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.closed = true
	if l.proc != nil {
		l.proc.stop(l.srv.stopSignal)
		l.proc = nil
	}
}

func (s *Server) localProc() (*localProc, error) {
	if s == nil || s.local == nil {
		return nil, ErrNotLocal
	}
	return s.local, nil
}

// Stop shuts a local server down the polite way (PostgreSQL: fast shutdown,
// SIGINT; Redis: SIGTERM), killing its process group if it is not gone within
// a few seconds. Its data directory and port are kept: Start brings it back.
// Stopping a stopped server does nothing.
func (s *Server) Stop() error {
	l, err := s.localProc()
	if err != nil {
		return err
	}
	return s.StopWith(l.srv.stopSignal)
}

// StopWith is Stop with another signal, e.g. syscall.SIGQUIT for a
// PostgreSQL immediate shutdown (crash recovery at the next start). The
// process group is killed if the server has not exited a few seconds after
// the signal.
func (s *Server) StopWith(sig syscall.Signal) error {
	l, err := s.localProc()
	if err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.proc != nil {
		l.proc.stop(sig)
		l.proc = nil
	}
	return nil
}

// Kill SIGKILLs a local server's whole process group at once (for PostgreSQL
// the postmaster and every backend), like a crash of the machine's processes
// without losing what the kernel already has. Data directory and port are
// kept: Start brings it back, running crash recovery if the server has any.
func (s *Server) Kill() error {
	l, err := s.localProc()
	if err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.proc != nil {
		pgid := l.proc.cmd.Process.Pid // Setpgid: the group id is the leader's pid
		_ = syscall.Kill(-pgid, syscall.SIGKILL)
		<-l.proc.done
		waitGroupGone(pgid, 5*time.Second)
		l.proc = nil
	}
	return nil
}

// Start starts a stopped local server again, on the same port, with the same
// arguments and data directory, appending to its log, and waits until it
// answers. Starting a running server does nothing. It fails if the port was
// taken in the meantime or the server does not come up.
func (s *Server) Start(ctx context.Context) error {
	l, err := s.localProc()
	if err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case l.closed:
		return errors.New("testenv: Start after Close")
	case l.proc != nil && !l.proc.exited():
		return nil
	}
	logPath := filepath.Join(l.srv.dir, l.srv.logFile)
	if f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644); err == nil {
		fmt.Fprintf(f, "--- testenv: restarting %s on port %d at %s ---\n", l.srv.name, l.port, time.Now().Format(time.RFC3339Nano))
		_ = f.Close()
	}
	l.opt.Logf("testenv: restarting local "+l.srv.name, "port", l.port, "dir", l.srv.dir)
	// A server that exits at once is started again, a few times: right after
	// a SIGKILL of its predecessor's process group the kernel may still be
	// releasing what it held (its shared memory, its lock file's process).
	var p *process
	for attempt := 1; ; attempt++ {
		if p, err = startProcess(l.srv.bin, l.srv.args(l.port), l.srv.dir, logPath, l.srv.owner, true); err != nil {
			return err
		}
		err = waitReady(ctx, p.done, func(ctx context.Context) error { return l.srv.ping(ctx, l.url) })
		if err == nil {
			break
		}
		exitedEarly := p.exited() // it ended by itself, rather than not answering
		p.stop(syscall.SIGKILL)
		if !exitedEarly || attempt == 3 || ctx.Err() != nil {
			return fmt.Errorf("restart %s on port %d: %w\n%s", l.srv.name, l.port, err, p.logTail())
		}
		l.opt.Logf("testenv: local "+l.srv.name+" exited while starting; starting it again", "attempt", attempt, "error", err)
		time.Sleep(time.Duration(attempt) * 300 * time.Millisecond)
	}
	l.proc = p
	l.opt.Logf("testenv: local "+l.srv.name+" ready again", "url", l.url)
	return nil
}

// Running reports whether a local server's process is running (false for
// servers that are not local).
func (s *Server) Running() bool {
	l, err := s.localProc()
	if err != nil {
		return false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.proc != nil && !l.proc.exited()
}

// Pid returns the process id of a running local server (its process group
// id too), or 0.
func (s *Server) Pid() int {
	l, err := s.localProc()
	if err != nil {
		return 0
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.proc == nil {
		return 0
	}
	return l.proc.cmd.Process.Pid
}

// Dir returns the temporary directory of a local server ("" otherwise). It
// is removed by Close.
func (s *Server) Dir() string {
	if s == nil {
		return ""
	}
	return s.dir
}

// LogPath returns the file a local server logs to ("" otherwise). It lives in
// Dir, so copy it before Close to keep it.
func (s *Server) LogPath() string {
	l, err := s.localProc()
	if err != nil {
		return ""
	}
	return filepath.Join(l.srv.dir, l.srv.logFile)
}

// waitGroupGone waits (at most limit) until no process of the group is left:
// the leader's exit does not mean its children are gone, and a PostgreSQL
// backend that still holds the old shared memory makes the next postmaster
// refuse to start ("pre-existing shared memory block is still in use").
func waitGroupGone(pgid int, limit time.Duration) {
	for deadline := time.Now().Add(limit); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if err := syscall.Kill(-pgid, 0); errors.Is(err, syscall.ESRCH) {
			return
		}
	}
}
