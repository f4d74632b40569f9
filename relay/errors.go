package relay

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"

	"github.com/redis/go-redis/v9"
)

// brokerUnavailable reports whether a publish error means Redis as a whole
// cannot take writes right now (down, unreachable, out of memory, read-only,
// loading), as opposed to a problem with one event. Such failures do not count
// against the event's attempts: the relay backs off and retries the batch.
func brokerUnavailable(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) ||
		errors.Is(err, redis.ErrClosed) || errors.Is(err, redis.ErrPoolTimeout) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return true
	}
	var netErr net.Error
	if errors.As(err, &netErr) {
		return true
	}
	var opErr *net.OpError
	if errors.As(err, &opErr) {
		return true
	}
	for _, prefix := range []string{"OOM", "LOADING", "READONLY", "MASTERDOWN", "BUSY", "TRYAGAIN",
		"CLUSTERDOWN", "NOREPLICAS", "MISCONF", "NOAUTH", "WRONGPASS", "NOPERM"} {
		if redis.HasErrorPrefix(err, prefix) {
			return true
		}
	}
	return strings.Contains(err.Error(), "connection refused")
}
