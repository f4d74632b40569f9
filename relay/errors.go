package relay

import (
	"context"
	"errors"
	"io"
	"net"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
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
// Errors are classified by type (go-redis's typed checks, net.Error), never
// by their text.
func brokerUnavailable(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, errBrokerDown) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) ||
		errors.Is(err, redis.ErrClosed) || errors.Is(err, redis.ErrPoolTimeout) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return true
	}
	var netErr net.Error // unreachable, refused, reset, timed out
	return errors.As(err, &netErr) || movedSlot(err) || redisRefusesWrites(err)
}

// redisRefusesWrites reports whether Redis answered with an error that is
// about the server, not the event: out of memory, loading, a read-only
// replica, its master down, a cluster down or resharding, too few replicas,
// too many clients, the relay's credentials or ACL, a script running past
// its time limit (BUSY) or a failed snapshot that stops writes (MISCONF; the
// last two have no typed check in go-redis: their RESP error code is the
// type).
func redisRefusesWrites(err error) bool {
	return redis.IsOOMError(err) || redis.IsLoadingError(err) || redis.IsReadOnlyError(err) ||
		redis.IsMasterDownError(err) || redis.IsClusterDownError(err) || redis.IsTryAgainError(err) ||
		redis.IsNoReplicasError(err) || redis.IsMaxClientsError(err) ||
		redis.IsAuthError(err) || redis.IsPermissionError(err) ||
		redis.HasErrorPrefix(err, "BUSY") || redis.HasErrorPrefix(err, "MISCONF")
}

// movedSlot reports whether err is a Redis Cluster redirection (MOVED, ASK):
// the stream's slot is served elsewhere now, or is being migrated. A
// cluster client follows them; a connection to one master (publishing with
// MinReplicas on a cluster) reports them, and the entry is retried once the
// client has reloaded the slot map.
func movedSlot(err error) bool {
	_, moved := redis.IsMovedError(err)
	_, ask := redis.IsAskError(err)
	return moved || ask
}

// maybeSent reports whether a publish that failed with err may still have
// reached the broker: anything but a connection that was never made, a
// client that refused to send, or the broker's own refusal (an error reply:
// OOM, READONLY, MOVED, no responders). A lost or timed-out reply, or
// replicas that did not confirm, may hide an entry that is in the stream: its
// redelivery window starts (migration 0011).
func maybeSent(err error) bool {
	var opErr *net.OpError
	var redisErr redis.Error
	switch {
	case err == nil:
		return false
	case errors.Is(err, errNotReplicated):
		return true // the XADD ran; its replicas did not confirm it
	case errors.As(err, &opErr) && opErr.Op == "dial":
		return false
	case errors.Is(err, redis.ErrPoolTimeout), errors.Is(err, redis.ErrClosed):
		return false
	case errors.As(err, &redisErr), movedSlot(err):
		return false // Redis answered, refusing
	case errors.Is(err, nats.ErrNoResponders), errors.Is(err, nats.ErrConnectionClosed), errors.Is(err, nats.ErrDisconnected),
		errors.Is(err, nats.ErrConnectionReconnecting), errors.Is(err, nats.ErrConnectionDraining),
		errors.Is(err, jetstream.ErrStreamNotFound), errors.Is(err, jetstream.ErrTooManyStalledMsgs):
		return false // nothing left the client, or no stream took it
	}
	return true
}
