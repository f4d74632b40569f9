package chaos

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/tedbank/outbox/internal/failpoint"
)

// restartDelay is how long the supervisor waits before restarting a process
// that exited; restartDelayMax bounds the delay after quick repeated exits
// (a process that cannot reach its servers exits 1 at start-up).
const (
	restartDelay    = 200 * time.Millisecond
	restartDelayMax = 2 * time.Second
	// termGrace is how long a process may take to exit after SIGTERM.
	termGrace = 15 * time.Second
)

// exitKind classifies how a process incarnation ended.
type exitKind string

const (
	exitKilled     exitKind = "killed"       // SIGKILL sent by the suite
	exitFailpoint  exitKind = "failpoint"    // SIGKILLed itself at its armed fail point
	exitTerminated exitKind = "terminated"   // exit 0 after the suite's SIGTERM
	exitStartFail  exitKind = "exit-1"       // exited 1 (could not start: a server was down)
	exitUnexpected exitKind = "unexpected"   // anything else: a bug
	exitIgnoredTrm exitKind = "ignored-term" // still running termGrace after SIGTERM, or exit != 0
)

// proc is one supervised outbox process (a relay or an anti-fraud consumer):
// it is restarted whenever it exits, until stopped for good.
type proc struct {
	name    string
	bin     string
	args    []string
	logPath string
	logf    func(format string, args ...any)

	mu          sync.Mutex
	cmd         *exec.Cmd
	waitDone    chan struct{} // closed when the current incarnation has exited
	started     time.Time
	incarnation int
	armed       string // fail point for the next start
	running     string // fail point the current incarnation runs with
	killedByUs  bool   // the current incarnation was SIGKILLed by the suite
	logOffset   int64  // where the current incarnation's output starts in the log
	termSent    time.Time
	stopping    bool
	gap         time.Duration // wait before the next restart (a deploy's gap)
	held        chan struct{} // while non-nil, no restart until it is closed (hold)
	exits       map[exitKind]int
	problems    []string // unexpected exits and ignored SIGTERMs
	fired       chan string
	loopDone    chan struct{}
	// history has one entry per incarnation (history[n-1] for #n): when it
	// started and ended, for the stranded-event analysis (stranded.go).
	history []incarnation
}

// incarnation is when one incarnation of a process ran; end is zero while it
// runs, and when the suite SIGKILLed it, the time of the kill (it exits a
// little later).
type incarnation struct{ start, end time.Time }

func newProc(name, bin, logPath string, logf func(string, ...any), args ...string) *proc {
	return &proc{
		name: name, bin: bin, args: args, logPath: logPath, logf: logf,
		exits: map[exitKind]int{}, fired: make(chan string, 16), loopDone: make(chan struct{}),
	}
}

// supervise starts the process and restarts it whenever it exits, until
// stop is called.
func (p *proc) supervise() {
	defer close(p.loopDone)
	delay := restartDelay
	for {
		done, err := p.start()
		if err != nil {
			p.logf("%s: %v", p.name, err)
			return
		}
		if done == nil { // stopping
			return
		}
		<-done
		p.mu.Lock()
		stopping, ranFor := p.stopping, time.Since(p.started)
		p.mu.Unlock()
		if stopping {
			return
		}
		if ranFor > 3*time.Second {
			delay = restartDelay
		} else {
			delay = min(2*delay, restartDelayMax)
		}
		p.mu.Lock()
		wait := max(delay, p.gap)
		p.gap = 0
		held := p.held
		p.mu.Unlock()
		if held != nil {
			<-held
			continue
		}
		time.Sleep(wait)
	}
}

// start starts one incarnation and a goroutine that records its exit; it
// returns nil, nil when the process is being stopped for good.
func (p *proc) start() (chan struct{}, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopping {
		return nil, nil
	}
	p.incarnation++
	fp := p.armed
	p.armed = ""
	log, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer log.Close()
	fmt.Fprintf(log, "=== chaos: start %s #%d %s=%q at %s\n", p.name, p.incarnation, failpoint.EnvVar, fp, stamp(time.Now()))
	if fi, err := log.Stat(); err == nil {
		p.logOffset = fi.Size()
	}
	cmd := exec.Command(p.bin, p.args...)
	cmd.Env = append(cleanEnv(), failpoint.EnvVar+"="+fp)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", p.name, err)
	}
	p.cmd, p.started, p.running, p.killedByUs, p.termSent = cmd, time.Now(), fp, false, time.Time{}
	p.history = append(p.history, incarnation{start: p.started})
	done := make(chan struct{})
	p.waitDone = done
	go func() {
		err := cmd.Wait()
		p.recordExit(cmd, err)
		close(done)
	}()
	return done, nil
}

func (p *proc) recordExit(cmd *exec.Cmd, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if n := len(p.history); n > 0 && p.history[n-1].end.IsZero() {
		p.history[n-1].end = time.Now()
	}
	ws, _ := cmd.ProcessState.Sys().(syscall.WaitStatus)
	var kind exitKind
	switch {
	case !p.termSent.IsZero():
		if err == nil {
			kind = exitTerminated
		} else {
			kind = exitIgnoredTrm
			p.problems = append(p.problems, fmt.Sprintf("%s #%d: %v after SIGTERM (want exit status 0)", p.name, p.incarnation, err))
		}
	case ws.Signaled() && ws.Signal() == syscall.SIGKILL && p.killedByUs:
		kind = exitKilled
	case ws.Signaled() && ws.Signal() == syscall.SIGKILL && p.running != "":
		kind = exitFailpoint
		select {
		case p.fired <- p.running:
		default:
		}
	case ws.Exited() && ws.ExitStatus() == 1:
		kind = exitStartFail
	default:
		kind = exitUnexpected
		p.problems = append(p.problems, fmt.Sprintf("%s #%d exited on its own: %v", p.name, p.incarnation, err))
	}
	p.exits[kind]++
	if f, ferr := os.OpenFile(p.logPath, os.O_WRONLY|os.O_APPEND, 0o644); ferr == nil {
		fmt.Fprintf(f, "=== chaos: %s #%d ended (%s: %v) after %s\n", p.name, p.incarnation, kind, err, time.Since(p.started).Round(time.Millisecond))
		_ = f.Close()
	}
}

// kill SIGKILLs the current incarnation (the supervisor restarts it).
func (p *proc) kill() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.aliveLocked() {
		p.killedByUs = true
		if n := len(p.history); n > 0 && p.history[n-1].end.IsZero() {
			p.history[n-1].end = time.Now()
		}
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	}
}

// stop stops the current incarnation (SIGSTOP: its connections stay open)
// and reports whether there was one to stop; cont continues it.
func (p *proc) stop() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.aliveLocked() {
		return false
	}
	return syscall.Kill(-p.cmd.Process.Pid, syscall.SIGSTOP) == nil
}

func (p *proc) cont() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil && p.cmd.Process != nil {
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGCONT)
	}
}

// terminate sends SIGTERM to the current incarnation and waits for it to
// exit; if it is still running after termGrace it is killed and reported.
// It returns the time the process took to exit.
func (p *proc) terminate(final bool) (time.Duration, error) {
	p.mu.Lock()
	if final {
		p.stopping = true
	}
	cmd, done := p.cmd, p.waitDone
	if !p.aliveLocked() {
		p.mu.Unlock()
		return 0, nil
	}
	// A process SIGTERMed before its main function installed the signal
	// handler dies of the signal (on this shared machine start-up can take
	// over a second): wait until the incarnation says it is running.
	if !p.readyLocked() {
		p.mu.Unlock()
		for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
			p.mu.Lock()
			ready := p.readyLocked()
			p.mu.Unlock()
			if ready {
				break
			}
		}
		p.mu.Lock()
		if p.cmd != cmd || !p.aliveLocked() {
			p.mu.Unlock()
			return 0, nil
		}
	}
	p.termSent = time.Now()
	start := p.termSent
	_ = cmd.Process.Signal(syscall.SIGTERM)
	p.mu.Unlock()
	select {
	case <-done:
	case <-time.After(termGrace):
		p.mu.Lock()
		p.problems = append(p.problems, fmt.Sprintf("%s #%d still running %s after SIGTERM", p.name, p.incarnation, termGrace))
		p.mu.Unlock()
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-done
		return time.Since(start), fmt.Errorf("%s ignored SIGTERM for %s", p.name, termGrace)
	}
	took := time.Since(start)
	if !cmd.ProcessState.Success() {
		return took, fmt.Errorf("%s exited with %v after SIGTERM", p.name, cmd.ProcessState)
	}
	return took, nil
}

// arm makes the next incarnation run with the fail point spec, and restarts
// the current one with SIGTERM to get there.
func (p *proc) arm(spec string) (time.Duration, error) {
	p.mu.Lock()
	p.armed = spec
	// Drain stale notifications.
	for len(p.fired) > 0 {
		<-p.fired
	}
	p.mu.Unlock()
	return p.terminate(false)
}

// redeploy stops the current incarnation gracefully, as terminate does,
// and has the supervisor start the next one only gap later, as a deploy
// that starts the new version after the old one stopped.
func (p *proc) redeploy(gap time.Duration) (time.Duration, error) {
	p.mu.Lock()
	p.gap = gap
	p.mu.Unlock()
	return p.terminate(false)
}

// hold stops the current incarnation gracefully, as terminate does, and
// starts the next one only at release: an operator's "stop the relays, repair,
// start them again".
func (p *proc) hold() (time.Duration, error) {
	p.mu.Lock()
	p.held = make(chan struct{})
	p.mu.Unlock()
	return p.terminate(false)
}

// release lets a held process start again.
func (p *proc) release() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.held != nil {
		close(p.held)
		p.held = nil
	}
}

// incarnationNo returns the number of the current (or last) incarnation.
func (p *proc) incarnationNo() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.incarnation
}

// logged reports whether the current incarnation's output contains s.
func (p *proc) logged(s string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.outputContainsLocked(s)
}

// outputContainsLocked reports whether the current incarnation's output
// contains s; p.mu must be held.
func (p *proc) outputContainsLocked(s string) bool {
	f, err := os.Open(p.logPath)
	if err != nil {
		return false
	}
	defer f.Close()
	b, err := io.ReadAll(io.NewSectionReader(f, p.logOffset, 1<<30))
	if err != nil {
		return false
	}
	return bytes.Contains(b, []byte(s))
}

// ready reports whether the current incarnation has started its work.
func (p *proc) ready() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.readyLocked()
}

// armedRunning reports whether the current incarnation runs with a fail point.
func (p *proc) armedRunning() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.running != "" && p.aliveLocked()
}

// readyLocked reports whether the current incarnation has logged that it
// started its work (after connecting to its servers); p.mu must be held.
func (p *proc) readyLocked() bool {
	if !p.aliveLocked() {
		return false
	}
	return p.outputContainsLocked(`msg="relay starting"`) || p.outputContainsLocked(`msg="consumer starting"`)
}

// aliveLocked reports whether the current incarnation is still running; p.mu
// must be held.
func (p *proc) aliveLocked() bool {
	if p.cmd == nil {
		return false
	}
	select {
	case <-p.waitDone:
		return false
	default:
		return true
	}
}

// incarnations returns a copy of the process's history.
func (p *proc) incarnations() []incarnation {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]incarnation(nil), p.history...)
}

func (p *proc) report() (exits map[exitKind]int, problems []string, incarnations int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	exits = map[exitKind]int{}
	for k, v := range p.exits {
		exits[k] = v
	}
	return exits, append([]string(nil), p.problems...), p.incarnation
}

// cleanEnv is the environment for child processes without anything that
// would point them at other servers or arm a fail point.
func cleanEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch {
		case k == "DATABASE_URL", k == "REDIS_URL", k == failpoint.EnvVar, k == "OUTBOX_LOG_FORMAT", k == "OUTBOX_LOG_LEVEL",
			strings.HasPrefix(k, "OTEL_"), strings.HasPrefix(k, "TEST_"):
			continue
		}
		env = append(env, kv)
	}
	return env
}

func stamp(t time.Time) string { return t.Format("15:04:05.000") }

// wakeState returns the wake-up state the current incarnation of a relay
// last logged ("wake state" debug lines: busy, asleep, ...): "unsure" before
// its first, "" if it cannot tell.
func (p *proc) wakeState() string {
	p.mu.Lock()
	off := p.logOffset
	p.mu.Unlock()
	f, err := os.Open(p.logPath)
	if err != nil {
		return ""
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return ""
	}
	const tail = 64 << 10
	from := max(off, fi.Size()-tail)
	b, err := io.ReadAll(io.NewSectionReader(f, from, fi.Size()-from))
	if err != nil {
		return ""
	}
	i := bytes.LastIndex(b, []byte(`msg="wake state"`))
	if i < 0 {
		if from == off {
			return "unsure"
		}
		return ""
	}
	line, _, _ := bytes.Cut(b[i:], []byte("\n"))
	return field(" "+string(line), "state")
}
