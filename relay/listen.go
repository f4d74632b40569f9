package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/tedbank/outbox/internal/retry"
	outboxsql "github.com/tedbank/outbox/sql"
)

const (
	listenConnectTimeout = 10 * time.Second
	listenPingTimeout    = 5 * time.Second
	// listenPingEvery: the LISTEN connection is pinged after this many quiet
	// poll intervals in a row. Together with the poll's one round trip, an
	// idle relay costs the database 1.25 round trips per poll interval, and
	// a half-open LISTEN connection is found within five intervals (the poll
	// delivers meanwhile).
	listenPingEvery  = 4
	listenBackoffMin = 100 * time.Millisecond
	listenBackoffMax = 30 * time.Second
	// listenHealthyAfter: a connection that lasted this long resets the
	// backoff. (At a minute, repeated short outages grew the wait to 25 s,
	// the LISTEN connection stayed down meanwhile, and every event waited
	// for the poll: found by the chaos suite.)
	listenHealthyAfter = 10 * time.Second
)

// listenLoop keeps one dedicated connection LISTENing and turns every
// notification into a wake-up. After each (re)connect it LISTENs first and
// then wakes the drainer, so rows committed while disconnected are caught up
// and none committed after the LISTEN can be missed.
func (r *Relay) listenLoop(ctx context.Context) {
	failures := 0
	for ctx.Err() == nil {
		start := time.Now()
		err := r.listen(ctx, failures)
		r.stats.listenUp.Store(false)
		r.cfg.Metrics.listen(false)
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, ErrMixedOwnership) {
			r.log.Error("relay stopping", slog.Any("error", err))
			r.stop(err)
			return
		}
		if time.Since(start) > listenHealthyAfter {
			failures = 0
		}
		failures++
		// No longer than a poll interval: while LISTEN is down, every event
		// waits for the poll; a reconnect attempt per poll costs little.
		d := retry.Backoff(failures, listenBackoffMin, min(listenBackoffMax, max(r.cfg.PollInterval, time.Second)))
		r.log.Warn("listen connection lost; reconnecting", slog.Any("error", err),
			slog.Int("attempt", failures), slog.Duration("retry_in", d))
		// The poll keeps draining meanwhile; once LISTENing again, listen
		// wakes the drainer to catch up on what committed in the gap. A
		// drainer that reaches the database again cuts the wait short.
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
		case <-t.C:
		case <-r.listenNow:
		}
		t.Stop()
	}
}

// listen LISTENs on one connection until it fails; failures is how many
// attempts in a row failed before this one.
func (r *Relay) listen(ctx context.Context, failures int) error {
	cctx, cancel := context.WithTimeout(ctx, listenConnectTimeout)
	conn, err := pgx.ConnectConfig(cctx, r.listenCfg)
	cancel()
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()

	lctx, cancel := context.WithTimeout(ctx, listenConnectTimeout)
	_, err = conn.Exec(lctx, "LISTEN "+pgx.Identifier{r.cfg.Channel}.Sanitize())
	cancel()
	if err != nil {
		return fmt.Errorf("listen %s: %w", r.cfg.Channel, err)
	}
	octx, cancel := context.WithTimeout(ctx, listenConnectTimeout)
	err = r.checkOwnership(octx, func(ctx context.Context, st outboxsql.Statement, dest ...any) error {
		return conn.QueryRow(ctx, st.SQL, st.Args...).Scan(dest...)
	}, true)
	cancel()
	if err != nil {
		return err
	}
	r.stats.listenUp.Store(true)
	r.cfg.Metrics.listen(true)
	if failures > 0 {
		r.log.Info("listen connection re-established", slog.String("channel", r.cfg.Channel),
			slog.Int("failed_attempts", failures))
	} else {
		r.log.Debug("listening", slog.String("channel", r.cfg.Channel))
	}
	// Notifications sent while no connection listened are lost, and a
	// PostgreSQL crash may have undone the flag's last change: the drain
	// this wakes catches up and tells writers again that the relay sleeps.
	r.resync.Store(true)
	r.kick()

	quiet := 0
	for {
		wctx, cancel := context.WithTimeout(ctx, r.cfg.PollInterval)
		n, err := conn.WaitForNotification(wctx)
		cancel()
		switch {
		case n != nil && n.Payload == r.wakePayload(), n != nil && n.Payload == r.freedPayload():
			quiet = 0 // this relay's own call to the others
		case n != nil && strings.HasPrefix(n.Payload, slotsFreedPrefix):
			quiet = 0
			r.slotsFreed.Store(true)
			r.kick()
		case n != nil:
			quiet = 0
			r.stats.notifications.Add(1)
			r.cfg.Metrics.notified()
			r.kick()
		case ctx.Err() != nil:
			return nil
		case pgconn.Timeout(err) && !conn.IsClosed():
			// Quiet for a poll interval. A socket read alone never notices a
			// half-open connection; a write does.
			if quiet++; quiet < listenPingEvery {
				continue
			}
			quiet = 0
			pctx, cancel := context.WithTimeout(ctx, listenPingTimeout)
			err := conn.Ping(pctx)
			cancel()
			if err != nil {
				return fmt.Errorf("ping: %w", err)
			}
		case err != nil:
			return fmt.Errorf("wait for notification: %w", err)
		default:
			return errListenerClosed
		}
	}
}

var errListenerClosed = errors.New("listen connection closed")
