package relay

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"

	"github.com/redis/go-redis/v9"
)

// errBrokerDown marks publish errors that the whole pipeline shared.
var errBrokerDown = errors.New("broker unavailable")

// errNotReplicated: Redis took the entries, but fewer replicas than
// Config.MinReplicas confirmed them in time.
var errNotReplicated = errors.New("not confirmed by enough replicas")

// pipelineDown reports whether every command of a pipeline failed with the
// same error although they went to different streams: whatever it says, that
// is the broker refusing writes, not a problem of each event. (The same error
// on one stream may be that stream's problem, e.g. WRONGTYPE.)
func pipelineDown(errs []error, streams []string) bool {
	if len(errs) < 2 || errs[0] == nil {
		return false
	}
	distinct := false
	for i, err := range errs[1:] {
		if err == nil || err.Error() != errs[0].Error() {
			return false
		}
		distinct = distinct || streams[i+1] != streams[0]
	}
	return distinct
}

// brokerUnavailable reports whether a publish error means Redis as a whole
// cannot take writes right now (down, unreachable, out of memory, read-only,
// loading), as opposed to a problem with one event. Such failures do not count
// against the event's attempts: the relay backs off and retries the batch.
func brokerUnavailable(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, errBrokerDown) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) ||
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
	if movedSlot(err) {
		return true
	}
	for _, prefix := range []string{"OOM", "LOADING", "READONLY", "MASTERDOWN", "BUSY", "TRYAGAIN",
		"CLUSTERDOWN", "NOREPLICAS", "MISCONF", "NOAUTH", "WRONGPASS", "NOPERM"} {
		if redis.HasErrorPrefix(err, prefix) {
			return true
		}
	}
	msg := err.Error()
	return strings.Contains(msg, "connection refused") || strings.Contains(msg, "max number of clients")
}

// movedSlot reports whether err is a Redis Cluster redirection (MOVED, ASK):
// the stream's slot is served elsewhere now, or is being migrated. A
// cluster client follows them; a connection to one master (publishing with
// MinReplicas on a cluster) reports them, and the entry is retried once the
// client has reloaded the slot map.
func movedSlot(err error) bool {
	return err != nil && (redis.HasErrorPrefix(err, "MOVED") || redis.HasErrorPrefix(err, "ASK"))
}
