// Package pgerr classifies PostgreSQL errors for the retry loops.
package pgerr

import (
	"cmp"
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5/pgconn"
)

// ConnLost reports whether err says that the connection a round trip ran on
// is gone while the server may well be up: the server terminated the backend
// (pg_terminate_backend, a pooler or server restarting, an idle timeout:
// every FATAL closes the connection) or the socket was closed or reset
// under it. Such a round trip did not commit (a FATAL ends its transaction,
// and a statement cut off before its reply is rolled back unless it was the
// COMMIT itself), so it can be tried again at once on a fresh connection of
// the pool, which destroys the dead one when it is released. A timeout is
// not a lost connection: the server may be overloaded, and retrying at once
// would add to its load.
func ConnLost(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) || pgconn.Timeout(err) {
		return false
	}
	if pgErr, ok := errors.AsType[*pgconn.PgError](err); ok {
		switch {
		case strings.HasPrefix(pgErr.Code, "28"), strings.HasPrefix(pgErr.Code, "53"), pgErr.Code == "57P03", pgErr.Code == "3D000":
			// Refused at connect (authentication, too many connections,
			// the server starting, no such database): a fresh connection
			// meets the same.
			return false
		}
		severity := cmp.Or(pgErr.SeverityUnlocalized, pgErr.Severity) // Severity follows lc_messages
		return severity == "FATAL" || severity == "PANIC"
	}
	return pgconn.SafeToRetry(err) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// TimedOut reports whether err is a round trip that got no answer in time
// (a context deadline, pgconn's timeout). Its connection may be one of
// several a half-open link left silent: they look open and swallow what is
// sent to them, and only a timeout tells.
func TimedOut(err error) bool {
	return err != nil && !errors.Is(err, context.Canceled) &&
		(errors.Is(err, context.DeadlineExceeded) || pgconn.Timeout(err))
}

// Deadlocked reports whether err is a deadlock the server broke by ending
// this round trip's transaction (40P01): nothing of it committed, and sent
// again, it takes its locks anew while the other transaction goes on.
func Deadlocked(err error) bool {
	pgErr, ok := errors.AsType[*pgconn.PgError](err)
	return ok && pgErr.Code == "40P01"
}
