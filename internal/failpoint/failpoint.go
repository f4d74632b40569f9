// Package failpoint kills the process at a named point, for crash tests.
//
// Production code marks its dangerous points with Inject("relay.after-xadd").
// When the environment variable OUTBOX_FAILPOINT names that point, the
// process sends itself SIGKILL there: no deferred function runs, connections
// drop abruptly and open transactions roll back, exactly as in a real crash.
// "name:N" fires on the N-th time the point is reached. When the variable is
// unset, Inject costs one comparison.
//
// Points: relay.after-claim, relay.after-xadd, fraud.after-read,
// fraud.after-effect.
package failpoint

import (
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
