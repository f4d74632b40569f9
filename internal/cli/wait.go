package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/tedbank/outbox/internal/connect"
)

// defaultWaitForServers is how long a relay or consumer started before its
// servers waits for them: long enough for a host booting or a deployment
// rolled out in any order; short enough that a wrong URL still ends the
// process while someone is looking.
const defaultWaitForServers = time.Minute

// waitFlag defines --wait-for-servers.
func waitFlag(fs *flag.FlagSet) *time.Duration {
	return fs.Duration("wait-for-servers", defaultWaitForServers,
		"at start, how long to wait for a server that does not answer (PostgreSQL, Redis, NATS), trying again with a logged backoff; 0: exit at once")
}

// errStoppedWaiting: the process was told to stop while it waited for a
// server; it exits 0, as a stop does.
var errStoppedWaiting = errors.New("stopped while waiting for a server")

// waitFor calls open until it returns anything but a server that does not
// answer (connect.ErrUnreachable), or until wait has passed: a process
// started before its servers starts when they do, instead of needing a
// supervisor to start it again. Each try is logged; the error that ends the
// wait says how long it waited. A server that answered no (a bad password,
// a missing database or table) ends it at once.
func waitFor[T any](ctx context.Context, log *slog.Logger, wait time.Duration, open func() (T, error)) (T, error) {
	deadline := time.Now().Add(wait)
	delay := 100 * time.Millisecond
	var logged time.Time
	for attempt := 1; ; attempt++ {
		v, err := open()
		if err == nil || !errors.Is(err, connect.ErrUnreachable) || wait <= 0 {
			if err == nil && attempt > 1 {
				log.Info("the server answers; starting", slog.Int("attempts", attempt))
			}
			return v, err
		}
		left := time.Until(deadline)
		if left <= 0 {
			return v, fmt.Errorf("%w (waited %s for it: --wait-for-servers)", err, wait)
		}
		if time.Since(logged) >= waitLogEvery {
			logged = time.Now()
			log.Warn("a server does not answer; waiting for it",
				slog.String("error", connect.RedactSecrets(err.Error())), slog.Int("attempt", attempt),
				slog.Duration("gives_up_in", left.Round(time.Second)))
		}
		t := time.NewTimer(min(delay, left))
		select {
		case <-ctx.Done():
			t.Stop()
			var zero T
			return zero, errStoppedWaiting
		case <-t.C:
		}
		delay = min(2*delay, time.Second)
	}
}

// waitLogEvery: while it waits, a process says so at most this often (it
// tries every second).
const waitLogEvery = 5 * time.Second

// waitForNATS is waitFor for a NATS connection as name.
func waitForNATS(ctx context.Context, log *slog.Logger, wait time.Duration, b *brokerChoice, name string) (*nats.Conn, jetstream.JetStream, error) {
	type conn struct {
		nc *nats.Conn
		js jetstream.JetStream
	}
	c, err := waitFor(ctx, log, wait, func() (conn, error) {
		nc, js, err := b.connect(name)
		return conn{nc, js}, err
	})
	return c.nc, c.js, err
}
