package testenv

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// process is a server process with its log file.
type process struct {
	cmd     *exec.Cmd
	logPath string
	done    chan struct{} // closed when the process has exited
}

// startProcess starts bin in its own process group, with stdout and stderr
// going to logPath, running as owner if not nil. The kernel kills it when
// the calling process dies.
// With appendLog the log file is appended to instead of truncated (a restart).
func startProcess(bin string, args []string, dir, logPath string, owner *account, appendLog bool) (*process, error) {
	mode := os.O_TRUNC
	if appendLog {
		mode = os.O_APPEND
	}
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|mode, 0o644)
	if err != nil {
		return nil, fmt.Errorf("create log file: %w", err)
	}
	defer logFile.Close() // the child has its own copy

	cmd := exec.Command(bin, args...)
	cmd.Dir = dir
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	cmd.SysProcAttr = sysProcAttr(owner)
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	p := &process{cmd: cmd, logPath: logPath, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait() // exit status of a stopped server is of no interest
		close(p.done)
	}()
	return p, nil
}

// stop sends sig to the process, waits up to stopGrace for it to exit, then
// kills its whole process group (the server and anything it forked).
func (p *process) stop(sig syscall.Signal) {
	_ = p.cmd.Process.Signal(sig)
	select {
	case <-p.done:
	case <-time.After(stopGrace):
	}
	pgid := p.cmd.Process.Pid // Setpgid: the group id is the leader's pid
	_ = syscall.Kill(-pgid, syscall.SIGKILL)
	<-p.done
	waitGroupGone(pgid, 5*time.Second)
}

// exited reports whether the process has ended.
func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// logTail returns the end of the process log.
func (p *process) logTail() string {
	b, err := os.ReadFile(p.logPath)
	if err != nil {
		return fmt.Sprintf("(no server log: %v)", err)
	}
	return tail(b)
}

// tail returns at most the last 4 KiB of b, labelled as server output.
func tail(b []byte) string {
	const max = 4 << 10
	b = []byte(strings.TrimSpace(string(b)))
	if len(b) > max {
		b = append([]byte("..."), b[len(b)-max:]...)
	}
	if len(b) == 0 {
		return "(server output empty)"
	}
	return "server output:\n" + string(b)
}

// account is the user a server runs as when the test process is root.
type account struct {
	username string
	uid, gid uint32
}

func (a *account) name() string {
	if a == nil {
		return "(current user)"
	}
	return a.username
}

// serverOwner returns the account to run PostgreSQL as: nil (the current
// user) unless running as root, else "postgres" or, failing that, "nobody".
func serverOwner() (*account, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	for _, name := range []string{"postgres", "nobody"} {
		u, err := user.Lookup(name)
		if err != nil {
			continue
		}
		uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
		gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
		if err1 != nil || err2 != nil {
			continue
		}
		return &account{username: name, uid: uint32(uid), gid: uint32(gid)}, nil
	}
	return nil, errors.New(`running as root, and neither user "postgres" nor "nobody" exists to run PostgreSQL as (PostgreSQL refuses to run as root)`)
}

func sysProcAttr(owner *account) *syscall.SysProcAttr {
	a := &syscall.SysProcAttr{
		Setpgid:   true,            // own process group: not hit by the terminal's ^C, killable as a group
		Pdeathsig: syscall.SIGKILL, // die with the test process
	}
	if owner != nil {
		a.Credential = &syscall.Credential{Uid: owner.uid, Gid: owner.gid, Groups: []uint32{}}
	}
	return a
}

// makeTempDir creates a fresh directory for a throw-away server's files,
// owned by owner if not nil: under the memory-backed directory (tempBase),
// else under the system temporary directory. owner must be able to reach
// it, so when the system temporary directory is not traversable by
// everyone, /tmp is used instead.
func makeTempDir(pattern string, owner *account) (string, error) {
	base := tempBase()
	if owner != nil && !traversable(base) {
		if !traversable("/tmp") {
			return "", fmt.Errorf("neither %s nor /tmp is reachable by user %s", base, owner.username)
		}
		base = "/tmp"
	}
	sweepOnce.Do(func() { sweep(base) })
	dir, err := os.MkdirTemp(base, pattern)
	if err != nil {
		return "", fmt.Errorf("create temporary directory: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, makerFile), []byte(processID(os.Getpid())), 0o644); err != nil {
		_ = os.RemoveAll(dir)
		return "", fmt.Errorf("record the directory's maker: %w", err)
	}
	if owner != nil {
		if err := os.Chown(dir, int(owner.uid), int(owner.gid)); err != nil {
			_ = os.RemoveAll(dir)
			return "", fmt.Errorf("chown %s to %s: %w", dir, owner.username, err)
		}
	}
	return dir, nil
}

// A server's directory records the process that made it (makerFile: its
// pid and start time, processID). A test process killed outright (SIGKILL,
// an OOM kill) takes its servers with it (Pdeathsig) but leaves their
// directories, in memory under memoryDir until the machine restarts: the
// first server a later test process starts removes the directories whose
// maker is gone (sweep).
const makerFile = "testenv-maker"

var sweepOnce sync.Once

// sweep removes base's server directories ("testenv-*") whose maker process
// is gone. A directory without a maker file, or that it cannot remove (another
// user's), is left alone.
func sweep(base string) {
	dirs, err := filepath.Glob(filepath.Join(base, "testenv-*"))
	if err != nil {
		return
	}
	for _, dir := range dirs {
		maker, err := os.ReadFile(filepath.Join(dir, makerFile))
		if err != nil {
			continue
		}
		pid, err := strconv.Atoi(strings.Fields(string(maker) + " x")[0])
		if err != nil || processID(pid) == string(maker) {
			continue // unreadable, or its maker runs
		}
		_ = os.RemoveAll(dir)
	}
}

// processID names process pid for as long as it runs: its pid and start time
// (/proc/PID/stat, field 22), so that a later process given the same pid
// is another; "" when it does not run (or there is no /proc).
func processID(pid int) string {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	// The command name, field 2, is in parentheses and may hold anything.
	i := strings.LastIndexByte(string(stat), ')')
	if i < 0 {
		return ""
	}
	fields := strings.Fields(string(stat[i+1:])) // from field 3 on
	if len(fields) < 20 {
		return ""
	}
	return fmt.Sprintf("%d %s", pid, fields[19])
}

// traversable reports whether every directory on the path to dir can be
// entered by any user.
func traversable(dir string) bool {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return false
	}
	for {
		fi, err := os.Stat(dir)
		if err != nil || !fi.IsDir() || fi.Mode().Perm()&0o001 == 0 {
			return false
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return true
		}
		dir = parent
	}
}

func removeDir(dir string) error {
	if err := os.RemoveAll(dir); err != nil {
		return fmt.Errorf("remove %s: %w", dir, err)
	}
	return nil
}

// freePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// findBinary looks for name in PATH, then in dirs.
func findBinary(name string, dirs ...string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	for _, d := range dirs {
		p := filepath.Join(d, name)
		if isExecutable(p) {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found in PATH or %s", name, strings.Join(dirs, ", "))
}

func isExecutable(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0
}

var pgVersionRE = regexp.MustCompile(`\(PostgreSQL\) (\d+)(?:\.(\d+))?`)

// findPostgresBin returns the directory holding initdb and postgres of the
// highest PostgreSQL version found in PATH and /usr/lib/postgresql/*/bin.
func findPostgresBin(ctx context.Context) (string, error) {
	var dirs []string
	if p, err := exec.LookPath("initdb"); err == nil {
		if r, err := filepath.EvalSymlinks(p); err == nil {
			dirs = append(dirs, filepath.Dir(r))
		}
		dirs = append(dirs, filepath.Dir(p))
	}
	matches, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	dirs = append(dirs, matches...)
	dirs = append(dirs, "/usr/local/pgsql/bin")

	type candidate struct {
		dir          string
		major, minor int
	}
	var found []candidate
	seen := map[string]bool{}
	for _, d := range dirs {
		if seen[d] {
			continue
		}
		seen[d] = true
		if !isExecutable(filepath.Join(d, "initdb")) || !isExecutable(filepath.Join(d, "postgres")) {
			continue
		}
		out, err := exec.CommandContext(ctx, filepath.Join(d, "postgres"), "--version").Output()
		if err != nil {
			continue
		}
		m := pgVersionRE.FindSubmatch(out)
		if m == nil {
			continue
		}
		major, _ := strconv.Atoi(string(m[1]))
		minor, _ := strconv.Atoi(string(m[2]))
		found = append(found, candidate{d, major, minor})
	}
	if len(found) == 0 {
		return "", errors.New("initdb and postgres not found in PATH or /usr/lib/postgresql/*/bin")
	}
	// Highest version first; among equals, the earlier (PATH) one.
	slices.SortStableFunc(found, func(a, b candidate) int {
		if a.major != b.major {
			return b.major - a.major
		}
		return b.minor - a.minor
	})
	return found[0].dir, nil
}

// A throw-away server's files (PostgreSQL's data directory above all) go to
// memoryDir, a memory-backed directory, when the machine has one with
// memoryDirRoom free: nothing of them is kept, and a slow disk made every
// test database's creation (a copy of the migrated template) cost 130-400
// ms where it costs 25 ms in memory (docs/log.md, thirteenth session). A
// container's /dev/shm (64 MiB by default) is too small, and TMPDIR set
// says where the user wants them.
const (
	memoryDir     = "/dev/shm"
	memoryDirRoom = 1 << 30
)

// tempBase is the directory throw-away servers' directories are made in:
// memoryDir when TMPDIR is not set and memoryDir is a directory everyone
// may write to with memoryDirRoom free, else the system temporary
// directory.
func tempBase() string {
	if os.Getenv("TMPDIR") == "" && roomy(memoryDir, memoryDirRoom) {
		return memoryDir
	}
	return os.TempDir()
}

// roomy reports whether dir is a directory anyone may enter and write to
// (sticky, like /tmp) with at least room bytes free.
func roomy(dir string, room uint64) bool {
	fi, err := os.Stat(dir)
	if err != nil || !fi.IsDir() || fi.Mode().Perm()&0o003 != 0o003 || !traversable(dir) {
		return false
	}
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		return false
	}
	return st.Bavail*uint64(st.Bsize) >= room
}
