package redisbroker

import (
	"context"
	"errors"
	"io"
	"net"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/relay/broker"
)

// Unavailable reports whether a publish error means Redis as a whole
// cannot take writes right now (down, unreachable, out of memory, read-only,
// loading), as opposed to a problem with one event. Such failures do not count
// against the event's attempts: the relay backs off and retries the batch.
// Errors are classified by type (go-redis's typed checks, net.Error), never
// by their text.
func (*Broker) Unavailable(err error) bool { return unavailable(err) }

func unavailable(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, broker.ErrUnavailable) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) ||
		errors.Is(err, redis.ErrClosed) || errors.Is(err, redis.ErrPoolTimeout) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return true
	}
	var netErr net.Error // unreachable, refused, reset, timed out
	return errors.As(err, &netErr) || movedSlot(err) || refusesWrites(err)
}

// refusesWrites reports whether Redis answered with an error that is
// about the server, not the event: out of memory, loading, a read-only
// replica, its master down, a cluster down or resharding, too few replicas,
// too many clients, the relay's credentials or ACL, a script running past
// its time limit (BUSY) or a failed snapshot that stops writes (MISCONF; the
// last two have no typed check in go-redis: their RESP error code is the
// type).
func refusesWrites(err error) bool {
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

// MaybeSent reports whether a publish that failed with err may still have
// reached Redis: anything but a connection that was never made, a client
// that refused to send, or Redis's own refusal (an error reply: OOM,
// READONLY, MOVED). A lost or timed-out reply, or replicas that did not
// confirm, may hide an entry that is in the stream.
func (*Broker) MaybeSent(err error) bool {
	var opErr *net.OpError
	var redisErr redis.Error
	switch {
	case err == nil:
		return false
	case errors.Is(err, ErrNotReplicated):
		return true // the XADD ran; its replicas did not confirm it
	case errors.As(err, &opErr) && opErr.Op == "dial":
		return false
	case errors.Is(err, redis.ErrPoolTimeout), errors.Is(err, redis.ErrClosed):
		return false
	case errors.As(err, &redisErr), movedSlot(err):
		return false // Redis answered, refusing
	}
	return true
}
