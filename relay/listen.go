package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/tedbank/outbox/internal/pgerr"
	"github.com/tedbank/outbox/internal/queries"
	"github.com/tedbank/outbox/internal/retry"
)

const (
	listenConnectTimeout = 10 * time.Second
	// watchEvery: between notifications, the relay looks this often, on its
	// LISTEN connection, for relays that died (relay_watch.sql): their claims
	// and slots are taken over at once, not when their leases run out. The
	// look doubles as the LISTEN connection's health check: one that does
	// not answer within watchTimeout is given up and reconnected.
	watchEvery   = 250 * time.Millisecond
	watchTimeout = 2 * time.Second
	// stallAfter: a live relay whose LISTEN backend has been idle this long
	// (four watches missed) stalled: a process stopped, paused or swapped
	// out, or a link gone quiet, its connections left open. The watch of
	// another relay terminates that backend, and the stalled relay's claims,
	// slots and "busy" word are taken over as a dead relay's (reap.go); woken,
	// it reconnects and goes on, its late marks fenced. Twice the watch's
	// slack would do for a healthy relay; a second keeps the takeover, with a
	// watch and a publish, under the 2 s an event may wait
	// (TestStalledRelayIsTakenOverWithinASecond).
	stallAfter = time.Second
	// The reconnect backoff grows only while attempts fail in a row: a
	// connection that was established (LISTENing, registered) resets it,
	// however short it lasted, so that every incident starts from the first
	// step (docs/design.md, "The relay's other numbers", says why).
	listenBackoffMin = 100 * time.Millisecond
	listenBackoffMax = 30 * time.Second
)

// listener is the relay's LISTEN connection, a service started by Run
// (run, below): it turns notifications into wake-ups, holds the
// relay's liveness (its backend's pid and advisory lock, migration 0012)
// and watches for relays that died or stalled.
type listener struct {
	r   *Relay // the relay it wakes
	cfg *pgx.ConnConfig
	// pid is the backend pid of the LISTEN connection while it is up (0
	// otherwise): it holds the relay's ownership lock, and its claims,
	// slots and "busy" word carry it, so that the other relays take them
	// over the moment it is gone.
	pid atomic.Uint32
	// past are the pids of this process's earlier LISTEN connections: its
	// claims under them are stamped with the new one when the connection
	// comes back. Owned by the listener's goroutine.
	past []int32
	// tried is closed once the first LISTEN connection is up, or its
	// attempt failed: the first drain waits for it (firstListenWait at
	// most), so that its claims and slots carry the LISTEN backend's pid.
	tried     chan struct{}
	triedOnce sync.Once
	// resync: the LISTEN connection came back; writers may have been told
	// nothing since (a PostgreSQL crash can undo the flag's last change), so
	// the next drain must say "sleep" again before waiting.
	resync atomic.Bool
	// established counts the LISTEN connections made (the drain that
	// takes resync notes the count: testsignal.Relay's Idle).
	established atomic.Uint64
	// now cuts the reconnect backoff short: the drainer reached the
	// database again.
	now chan struct{}
}

// newListener returns the listener of r, connecting with cfg (nil: the
// pool's connection config with application_name "<name>-listen").
func newListener(r *Relay, cfg *pgx.ConnConfig) *listener {
	if cfg == nil {
		cfg = r.pool.Config().ConnConfig.Copy()
		app := cfg.RuntimeParams["application_name"]
		if app == "" {
			app = "outbox-relay"
		}
		cfg.RuntimeParams["application_name"] = app + "-listen"
	}
	return &listener{r: r, cfg: cfg, tried: make(chan struct{}), now: make(chan struct{}, 1)}
}

// attempted ends the first drain's wait for the LISTEN connection.
func (l *listener) attempted() { l.triedOnce.Do(func() { close(l.tried) }) }

// run keeps one dedicated connection LISTENing and turns every
// notification into a wake-up. After each (re)connect it LISTENs first and
// then wakes the drainer, so rows committed while disconnected are caught up
// and none committed after the LISTEN can be missed.
func (l *listener) run(ctx context.Context) {
	r := l.r
	failures := 0
	for ctx.Err() == nil {
		established, err := l.listen(ctx, failures)
		l.attempted()
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
		if established {
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
		case <-l.now:
		}
		t.Stop()
	}
}

// listen LISTENs on one connection until it fails; failures is how many
// attempts in a row failed before this one. It reports whether the
// connection was established (LISTENing and registered) before it failed.
func (l *listener) listen(ctx context.Context, failures int) (established bool, _ error) {
	err := l.listenOn(ctx, failures, &established)
	return established, err
}

func (l *listener) listenOn(ctx context.Context, failures int, established *bool) error {
	r := l.r
	cctx, cancel := context.WithTimeout(ctx, listenConnectTimeout)
	conn, err := pgx.ConnectConfig(cctx, l.cfg)
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
	// Hold this relay's ownership lock, then register, then look for relays
	// of the other ownership: only registered relays count (any role may
	// take an advisory lock, migration 0018), and registering first lets
	// two relays of different ownerships starting at once see each other.
	octx, cancel := context.WithTimeout(ctx, listenConnectTimeout)
	err = r.holdOwnership(octx, conn)
	cancel()
	if err != nil {
		return err
	}
	// The server must notice a half-open LISTEN connection (the relay's
	// machine or link gone) to release its lock: only then do the other
	// relays take this relay's claims and slots over (migration 0012).
	kctx, cancel := context.WithTimeout(ctx, listenConnectTimeout)
	ka := queries.RelayServerKeepalive(serverKeepaliveIdle, serverKeepaliveInterval, serverKeepaliveCount, serverUserTimeout)
	_, err = conn.Exec(kctx, ka.SQL, ka.Args...)
	cancel()
	if err != nil {
		return fmt.Errorf("set the server's keepalives on the LISTEN connection: %w", err)
	}
	var pid int32
	rctx, cancel := context.WithTimeout(ctx, listenConnectTimeout)
	err = queryRowOn(rctx, conn, queries.RelayRegister(r.cfg.Name, r.own.membershipMS())).Scan(&pid)
	cancel()
	if err != nil {
		return fmt.Errorf("register the relay: %w", err)
	}
	octx, cancel = context.WithTimeout(ctx, listenConnectTimeout)
	err = r.checkOwnership(octx, func(ctx context.Context, st queries.Statement, dest ...any) error {
		return conn.QueryRow(ctx, st.SQL, st.Args...).Scan(dest...)
	})
	cancel()
	if err != nil {
		// Its membership outlives it only until a live relay's watch finds
		// its backend gone (relay_bury.sql).
		return err
	}
	// This relay's claims and slots taken under its earlier LISTEN
	// connections, or while it had none, are its own still: stamp them with
	// the new pid before the other relays (or this one) take them for a dead
	// relay's (an earlier backend may be alive still, behind a half-open
	// link, but only a member's pid is a live relay's: migration 0018).
	// Claims it does not know of (their reply was lost, or a previous
	// process of its name took them while its LISTEN connection was down)
	// keep the earlier pid, or get one no live relay has if they had none:
	// the reaper returns them to pending now.
	st := queries.RelayRestamp(r.cfg.Name, l.past, r.loop.held.list())
	sctx, cancel := context.WithTimeout(ctx, listenConnectTimeout)
	_, err = conn.Exec(sctx, st.SQL, st.Args...)
	cancel()
	if err != nil {
		return fmt.Errorf("restamp the relay's claims and slots: %w", err)
	}
	r.reaper.bury(watchDead)
	l.past = append(l.past[max(len(l.past)-15, 0):], pid)
	l.pid.Store(uint32(pid))
	defer l.pid.Store(0)
	l.attempted()
	*established = true
	// A partition owner renews now: its slots carry the new pid (row
	// claims never read slotsFreed).
	r.slotsFreed.Store(true)
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
	// (established first: the drain that takes resync notes it.)
	l.established.Add(1)
	l.resync.Store(true)
	r.kick()
	// A relay of this name may have died just before: take its claims now.
	r.reaper.bury(watchDead)

	lastWatch := time.Now()
	for {
		wait := time.Until(lastWatch.Add(watchEvery))
		if wait <= 0 {
			// Due whatever the notifications do: a steady stream of them
			// must not put the watch off, since the other relays take a
			// LISTEN backend quiet for stallAfter for a stalled relay's.
			// A socket read alone never notices a half-open connection;
			// the watch's round trip does. The next one is due watchEvery
			// after this one ends, so that a slow server's watches never
			// run back to back with no wait for notifications in between.
			var w watchResult
			gen := r.pool.resets.Load()
			wctx, cancel := context.WithTimeout(ctx, watchTimeout)
			err := queryRowOn(wctx, conn, queries.RelayWatch(stallAfter.Milliseconds())).Scan(&w.dead, &w.silenced, &w.stalled)
			cancel()
			lastWatch = time.Now()
			if err != nil {
				if ctx.Err() != nil {
					return nil
				}
				if pgerr.TimedOut(err) {
					r.pool.dropSilent(gen, "the LISTEN connection's watch timed out")
				}
				return fmt.Errorf("watch: %w", err)
			}
			if len(w.stalled) > 0 {
				r.reaper.stalled.Store(&w.stalled)
			}
			r.reaper.bury(w.what())
			continue
		}
		wctx, cancel := context.WithTimeout(ctx, wait)
		n, err := conn.WaitForNotification(wctx)
		cancel()
		switch {
		case n != nil && n.Payload == r.wakePayload(), n != nil && n.Payload == r.freedPayload():
			// this relay's own call to the others
		case n != nil && strings.HasPrefix(n.Payload, slotsFreedPrefix):
			r.slotsFreed.Store(true)
			r.kick()
		case n != nil:
			r.stats.notifications.Add(1)
			r.cfg.Metrics.notified()
			r.kick()
		case ctx.Err() != nil:
			return nil
		case pgconn.Timeout(err) && !conn.IsClosed():
			// the watch is due
		case err != nil:
			return fmt.Errorf("wait for notification: %w", err)
		default:
			return errListenerClosed
		}
	}
}

var errListenerClosed = errors.New("listen connection closed")

// notify is a NOTIFY on this relay's channel. Writers' payloads are empty;
// a relay's are these.
func (r *Relay) notify(payload string) queries.Statement {
	return queries.RelayNotify(r.cfg.Channel, payload)
}

// wakePayload is the payload of the notifications a relay that owns
// partitions sends to wake the other relays (its listener ignores its own).
func (r *Relay) wakePayload() string { return "relay:" + r.cfg.Name }

// freedPayload is the payload of the notification a relay sends when it gives
// slots back (more than its share, or all of them on its way out): the
// other relays renew at once and take them, instead of at their next
// renewal.
func (r *Relay) freedPayload() string { return slotsFreedPrefix + r.cfg.Name }

const slotsFreedPrefix = "relay-slots-freed:"

// The server's TCP keepalives on the LISTEN connection (set_config; ignored on
// a Unix socket): the server gives up on a connection whose relay stopped
// answering after about idle + interval × count seconds, or when data it sent
// stays unacknowledged for serverUserTimeout ms, and releases the relay's
// lock: its claims and slots move then (about 5 s after the link went dead).
const (
	serverKeepaliveIdle     = 2
	serverKeepaliveInterval = 1
	serverKeepaliveCount    = 3
	serverUserTimeout       = 5000
)

func queryRowOn(ctx context.Context, conn *pgx.Conn, st queries.Statement) pgx.Row {
	return conn.QueryRow(ctx, st.SQL, st.Args...)
}
