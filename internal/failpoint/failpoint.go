//go:build failpoint

package failpoint

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
)

// Enabled: this binary was built with -tags failpoint.
const Enabled = true

var (
	armedName  string
	armedAfter int64 = 1
	hits       atomic.Int64
	// stop: the kill points stop the process (SIGSTOP) instead of killing
	// it; it goes on from there once continued (SIGCONT).
	stop = os.Getenv(ActionEnvVar) == "stop"
)

func init() {
	spec := os.Getenv(EnvVar)
	name, n, ok := strings.Cut(spec, ":")
	armedName = name
	if ok {
		if v, err := strconv.ParseInt(n, 10, 64); err == nil && v > 0 {
			armedAfter = v
		}
	}
}

// Inject kills the process with SIGKILL if name is the armed fail point and
// this is the hit it was armed for.
func Inject(name string) {
	if armedName == "" || name != armedName {
		return
	}
	if hits.Add(1) == armedAfter {
		if stop {
			_ = syscall.Kill(os.Getpid(), syscall.SIGSTOP) // returns once continued
			return
		}
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // never returns; SIGKILL cannot be caught
	}
}

// Error returns a non-nil error if name is the armed fail point and this is
// the hit it was armed for; every other call returns nil. The error names the
// point, so that the logs show where it came from.
func Error(name string) error {
	if armedName == "" || name != armedName {
		return nil
	}
	if hits.Add(1) == armedAfter {
		return fmt.Errorf("failpoint %s: injected error", name)
	}
	return nil
}
