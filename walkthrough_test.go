package outbox_test

import (
	"bufio"
	"context"
	"crypto/sha256"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/outboxtest"
)

// A shell block of the docs: the lines of a ```sh fence, where it is, and
// why it is not run when the line before its fence says so
// (<!-- not run: why -->).
type shellBlock struct {
	file, heading string
	line          int
	text          string
	notRun        string
}

var notRunPattern = regexp.MustCompile(`^<!-- not run: (.+) -->$`)

// shellBlocks extracts every ```sh block of README.md and docs/*.md, in
// order (README first, then the docs by name).
func shellBlocks(t *testing.T) []shellBlock {
	t.Helper()
	docs, err := filepath.Glob("docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	var blocks []shellBlock
	for _, name := range append([]string{"README.md"}, docs...) {
		f, err := os.Open(name)
		if err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(f)
		var cur *shellBlock
		heading, prev := "", ""
		for n := 1; sc.Scan(); n++ {
			line := sc.Text()
			switch {
			case cur != nil && strings.HasPrefix(line, "```"):
				blocks = append(blocks, *cur)
				cur = nil
			case cur != nil:
				cur.text += line + "\n"
			case line == "```sh":
				cur = &shellBlock{file: name, heading: heading, line: n}
				if m := notRunPattern.FindStringSubmatch(prev); m != nil {
					cur.notRun = m[1]
				}
			case strings.HasPrefix(line, "#"):
				heading = strings.TrimSpace(strings.TrimLeft(line, "#"))
			}
			prev = line
		}
		_ = f.Close()
		if err := sc.Err(); err != nil {
			t.Fatal(err)
		}
	}
	return blocks
}

// What a block that is not run may give as its reason: CI runs it itself
// (the test checks .ci/run does), or it needs what a test cannot have.
var notRunReasons = []string{"CI runs it", "the chaos suite", "needs Docker", "minutes of benchmarking", "a PgBouncer and a second server"}

// The README's walkthroughs work when pasted, in order, on a fresh
// database and Redis: each ```sh block runs as written (bash -e: every
// command must succeed), waits for what it needs, and stops what it
// starts. A block that is not run says why, in the Markdown, beside it.
func TestWalkthroughsRunAsWritten(t *testing.T) {
	blocks := shellBlocks(t)
	ci, err := os.ReadFile(".ci/run")
	if err != nil {
		t.Fatal(err)
	}
	var run []shellBlock
	for _, b := range blocks {
		if b.notRun == "" {
			run = append(run, b)
			continue
		}
		if !slicesContainsPrefix(notRunReasons, b.notRun) {
			t.Errorf("%s:%d: a block not run says %q; say one of %q", b.file, b.line, b.notRun, notRunReasons)
		}
		if strings.HasPrefix(b.notRun, "CI runs it") {
			for _, cmd := range strings.Split(strings.TrimSpace(b.text), "\n") {
				cmd, _, _ = strings.Cut(cmd, "#")
				if f := strings.Fields(cmd); len(f) > 0 && !strings.Contains(string(ci), strings.Join(f[:min(2, len(f))], " ")) {
					t.Errorf("%s:%d: says CI runs it, but .ci/run has no %q", b.file, b.line, cmd)
				}
			}
		}
	}
	if len(run) < 3 {
		t.Fatalf("only %d shell blocks to run: the README's walkthroughs are ```sh blocks", len(run))
	}

	// Two runs of this test at once in one checkout (two go test commands)
	// take turns, as they share the checkout's bin/ and the Redis database.
	lockWalkthrough(t)
	env := walkthroughEnv(t)
	// What the blocks write in the working directory (operations.md's
	// lost.json) is the test's to remove, unless it was there before.
	for _, name := range []string{"lost.json"} {
		if _, err := os.Stat(name); err != nil {
			t.Cleanup(func() { _ = os.Remove(name) })
		}
	}
	for _, b := range run {
		t.Logf("%s:%d (%s)", b.file, b.line, b.heading)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		// A process group of its own: what the block starts in the
		// background stays in it (no job control), so what is left of it
		// when bash ends is what the block did not stop.
		cmd := exec.CommandContext(ctx, "bash", "-e", "-o", "pipefail", "-c", b.text)
		cmd.Env = env
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
		cmd.WaitDelay = 5 * time.Second
		out, err := cmd.CombinedOutput()
		cancel()
		left := ""
		if cmd.Process != nil {
			left = leftovers(cmd.Process.Pid)
		}
		if err != nil {
			t.Fatalf("%s:%d (%s) failed: %v\n--- block\n%s--- output\n%s", b.file, b.line, b.heading, err, b.text, out)
		}
		if left != "" {
			t.Errorf("%s:%d (%s) left processes running:\n%s", b.file, b.line, b.heading, left)
		}
	}
}

// lockWalkthrough holds a lock of this checkout's until the test ends.
func lockWalkthrough(t *testing.T) {
	t.Helper()
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	name := filepath.Join(os.TempDir(), fmt.Sprintf("outbox-walkthrough-%x.lock", sha256.Sum256([]byte(wd))))
	f, err := os.OpenFile(name, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() }) // closing releases the lock; cleanups run last-in first-out
}

func slicesContainsPrefix(prefixes []string, s string) bool {
	for _, p := range prefixes {
		if strings.HasPrefix(s, p) {
			return true
		}
	}
	return false
}

// walkthroughEnv is the environment of a newcomer's shell with the URLs of
// a fresh database and an empty Redis database of the test's own (the
// blocks name their streams and groups as a user's would: no prefix), and
// the built outbox command on PATH as "outbox".
func walkthroughEnv(t *testing.T) []string {
	t.Helper()
	db := outboxtest.PostgresURL(t)
	rdb := outboxtest.NewRedis(t)
	u, err := url.Parse(rdb.URL)
	if err != nil {
		t.Fatal(err)
	}
	const walkDB = 13 // the blocks' keys have no prefix: a Redis database of their own
	u.Path = fmt.Sprintf("/%d", walkDB)
	own := redis.NewClient(&redis.Options{Addr: u.Host, DB: walkDB, Username: rdb.Options().Username, Password: rdb.Options().Password})
	t.Cleanup(func() { _ = own.Close() })
	if n, err := own.DBSize(context.Background()).Result(); err != nil || n != 0 {
		t.Fatalf("Redis database %d of %s is not empty (%d keys, err %v): the walkthrough needs it to itself", walkDB, u.Host, n, err)
	}
	t.Cleanup(func() { _ = own.FlushDB(context.Background()).Err() })
	bin := t.TempDir()
	if err := os.Symlink(outboxtest.Binary(t), filepath.Join(bin, "outbox")); err != nil {
		t.Fatal(err)
	}
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch k {
		case "DATABASE_URL", "REDIS_URL", "NATS_URL", "OUTBOX_BROKER", "PATH":
		default:
			env = append(env, kv)
		}
	}
	return append(env, "DATABASE_URL="+db, "REDIS_URL="+u.String(), "PATH="+bin+string(os.PathListSeparator)+os.Getenv("PATH"))
}

// leftovers lists, and kills, the processes left in the process group pgid.
func leftovers(pgid int) string {
	out, _ := exec.Command("pgrep", "-a", "-g", strconv.Itoa(pgid)).Output()
	_ = syscall.Kill(-pgid, syscall.SIGKILL)
	return strings.TrimSpace(string(out))
}
