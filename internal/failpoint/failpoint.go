// Package failpoint kills the process at a named point, for crash tests.
//
// Production code marks its dangerous points with Inject("relay.after-xadd").
// When the environment variable OUTBOX_FAILPOINT names that point, the
// process sends itself SIGKILL there: no deferred function runs, connections
// drop abruptly and open transactions roll back, exactly as in a real crash.
// "name:N" fires on the N-th time the point is reached. When the variable is
// unset, Inject costs one comparison.
//
// Error("relay.after-busy") marks a point where a failing round trip is
// worse than a crash: when armed, it returns an error once, on the N-th hit,
// and the process goes on running (the error path is what is tested).
//
// Kill points: relay.after-claim, relay.after-xadd, fraud.after-read,
// fraud.after-effect. Error points: relay.after-busy.
package failpoint

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
)

// EnvVar is the environment variable that arms a fail point.
const EnvVar = "OUTBOX_FAILPOINT"

var (
	armedName  string
	armedAfter int64 = 1
	hits       atomic.Int64
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
