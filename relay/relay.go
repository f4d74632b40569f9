// Package relay publishes committed outbox events to a broker.Broker: Redis
// Streams (package relay/redisbroker) or NATS JetStream (relay/natsbroker).
//
// A Relay listens on one dedicated PostgreSQL connection for the outbox
// trigger's NOTIFY, and drains the outbox on every notification and on a slow
// fallback poll. Draining claims a batch of rows with FOR UPDATE SKIP LOCKED
// (status publishing, claimed_at, a fresh claim token), publishes them with
// one pipelined round trip of XADDs outside any database transaction, then
// marks published only the rows its claim still owns. A reaper returns claims
// whose lease expired to pending. Any number of relays can run side by side.
// That is the card's path and the zero Config's (Ownership OwnRows). With
// OwnPartitions the relays lease slots of partition keys instead and read
// their slots' rows without claiming them (one update per event, not two);
// OwnAuto, the outbox relay command's default, follows the relays running
// on the database, and leases partitions where no row claimer runs or may
// run unseen.
//
// Delivery is at least once: a relay that dies between XADD and the mark, or
// a stale relay fenced out after its lease, leaves a duplicate in the stream.
// Consumers deduplicate on event_id.
//
// The code, one concept per file, in the order a batch meets it: relay.go
// (the Relay, Run), listen.go (the LISTEN connection), loop.go (the drainer's
// loop: when to drain), drain.go (one drain: batches until empty), wakeup.go
// (the wake-up protocol's states and the relay's words to writers),
// batch.go (one batch: claim, publish through the broker, record), claim.go
// (the claim's round trip), conns.go (the pool, and what a round trip that
// timed out does to it), outcome.go and mark.go (recording
// what the publish did), ownership.go (row claims or partition leases,
// chosen once: partitions.go drives the leases, whose protocol is package
// relay/internal/leases), reap.go (expired claims back to
// pending), floor.go (where reads start), config.go, metrics.go and
// errors.go. The broker's own work (trimming Redis Streams) is the broker
// package's.
package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/internal/tracing"
	"github.com/tedbank/outbox/relay/broker"
)

var tracer = tracing.Tracer("github.com/tedbank/outbox/relay")

const (
	// claimTimeout bounds the claim; markTimeout bounds the statements that
	// record a batch's outcome. With the publish timeout (at most 5s by
	// default) a batch in flight at shutdown is settled within 10s.
	claimTimeout = 10 * time.Second
	markTimeout  = 3 * time.Second
	// releaseDelay keeps released rows unclaimable briefly, so that relays
	// do not spin on an unavailable broker.
	releaseDelay = 100 * time.Millisecond
)

// Relay moves events from outbox_messages to a broker.
type Relay struct {
	cfg    Config
	pool   *conns
	broker broker.Broker
	log    *slog.Logger
	wake   chan struct{}
	stats  counters

	// own: how this relay owns what it publishes (ownership.go), chosen
	// once from Config.Ownership, or when Run starts for OwnAuto; ownName
	// names it. Owned by drainLoop.
	own     owner
	ownName atomic.Pointer[string]
	// slotsFreed: another relay gave partition slots back; renew now.
	slotsFreed atomic.Bool

	// loop is what the drainer owns between drains (loop.go).
	loop drainState
	// reaper is the maintenance service (reap.go): expired claims, events
	// past their redelivery window, the work of relays that died.
	reaper *reaper
	// listener is the LISTEN connection (listen.go): wake-ups, liveness,
	// the watch for relays that died.
	listener *listener
	// stop ends Run with a cause (ErrMixedOwnership, found by the LISTEN
	// connection); set by Run.
	stop context.CancelCauseFunc
}

// Stats counts what a relay did since it started.
type Stats struct {
	Claims        int64 // claim (or, with partition leases, read) round trips, empty ones included
	Claimed       int64 // rows claimed
	Published     int64 // rows marked published
	Fenced        int64 // rows whose mark found another claim (stale relay)
	Failed        int64 // failed publish attempts recorded
	Released      int64 // rows given back without an attempt (broker down, shutdown)
	Reaped        int64 // expired claims returned to pending
	Notifications int64 // NOTIFYs received
	Polls         int64 // fallback polls
	PollsWithWork int64 // fallback polls that found rows (missed wake-ups)
	ListenUp      bool  // LISTEN connection currently established
	// FloorPassedOver counts the times the read floor went past writers of
	// the outbox open longer than a second (floor.go).
	FloorPassedOver int64
}

type counters struct {
	claims, claimed, published, fenced, failed, released, reaped atomic.Int64
	notifications, polls, pollsWithWork, floorPassedOver         atomic.Int64
	listenUp                                                     atomic.Bool
}

// New returns a relay that claims from pool and publishes through b
// (redisbroker.New, natsbroker.New). It checks cfg but does not connect;
// Run does.
func New(pool *pgxpool.Pool, b broker.Broker, cfg Config) (*Relay, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if b == nil {
		return nil, fmt.Errorf("%w: no broker", ErrConfig)
	}
	cfg = cfg.withDefaults()
	if c, ok := b.(interface{ ConfirmTimeout() time.Duration }); ok && c.ConfirmTimeout() >= cfg.PublishTimeout {
		return nil, fmt.Errorf("%w: the broker waits up to %s for its replicas: the publish timeout (%s) must be longer",
			ErrConfig, c.ConfirmTimeout(), cfg.PublishTimeout)
	}
	log := cfg.Logger.With(slog.String("relay", cfg.Name))
	r := &Relay{
		cfg:  cfg,
		pool: &conns{Pool: pool, log: log},
		log:  log,
		wake: make(chan struct{}, 1),

		// A relay starting cannot know what writers were last told (a
		// relay killed while draining leaves them silent): it says
		// "sleep" before it waits for a notification.
		loop:   drainState{state: unsure},
		broker: b,
	}
	r.reaper = newReaper(r)
	r.listener = newListener(r, cfg.ListenConfig)
	r.chooseOwnership(cfg.Ownership)
	return r, nil
}

// NewWithBroker is New.
//
// Deprecated: New takes the broker.
func NewWithBroker(pool *pgxpool.Pool, b broker.Broker, cfg Config) (*Relay, error) {
	return New(pool, b, cfg)
}

// Ready reports why the relay cannot do its work right now, or nil: the
// database and the broker answer and the LISTEN connection is up.
func (r *Relay) Ready(ctx context.Context) error {
	if err := r.pool.Ping(ctx); err != nil {
		return fmt.Errorf("postgres: %w", err)
	}
	if err := r.broker.Ping(ctx); err != nil {
		return fmt.Errorf("broker: %w", err)
	}
	if !r.stats.listenUp.Load() {
		return errors.New("LISTEN connection down")
	}
	return nil
}

// Config returns the relay's effective configuration.
func (r *Relay) Config() Config { return r.cfg }

// Stats returns a snapshot of the relay's counters.
func (r *Relay) Stats() Stats {
	s := &r.stats
	return Stats{
		Claims: s.claims.Load(), Claimed: s.claimed.Load(), Published: s.published.Load(), Fenced: s.fenced.Load(),
		Failed: s.failed.Load(), Released: s.released.Load(), Reaped: s.reaped.Load(),
		Notifications: s.notifications.Load(), Polls: s.polls.Load(),
		PollsWithWork: s.pollsWithWork.Load(), ListenUp: s.listenUp.Load(), FloorPassedOver: s.floorPassedOver.Load(),
	}
}

// Run relays until ctx is cancelled, then stops claiming, finishes (or
// releases) the batch in flight and returns nil. It returns an error only if
// it cannot start.
func (r *Relay) Run(ctx context.Context) error {
	if c, ok := r.broker.(broker.Checker); ok {
		if err := c.Check(ctx); err != nil {
			return err
		}
	}
	if r.resolveOwnership(ctx) != nil {
		return nil // stopped before it could choose (it waits for the database)
	}
	if err := r.refuseMixedOwnership(ctx); err != nil {
		r.forgetOwnership()
		return err
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	r.stop = cancel
	r.log.Info("relay starting", slog.String("ownership", r.Ownership()),
		slog.Int("batch", r.cfg.BatchSize), slog.Duration("lease", r.cfg.Lease),
		slog.Duration("poll", r.cfg.PollInterval), slog.String("channel", r.cfg.Channel))

	if p, ok := r.broker.(broker.Preparer); ok {
		// Consumers can attach before the first event: best effort, the
		// first publish tries again.
		if err := p.Prepare(ctx); err != nil {
			r.log.Warn("preparing the broker failed; retrying at the first publish", slog.Any("error", err))
		}
	}
	var wg sync.WaitGroup
	// The LISTEN connection holds this relay's liveness: it stays up until
	// the drainer has finished (or released) its batch in flight and given
	// its slots back, so that the other relays do not take a stopping
	// relay for dead and publish its batch a second time.
	lctx, lcancel := context.WithCancel(context.WithoutCancel(ctx))
	var lwg sync.WaitGroup
	lwg.Go(func() {
		defer cancel(nil) // the listener stopped the relay (ErrMixedOwnership)
		r.listener.run(lctx)
	})
	for _, run := range r.services() {
		wg.Go(func() { run(ctx) })
	}
	r.drainLoop(ctx)
	cancel(nil)
	wg.Wait()
	lcancel()
	lwg.Wait()
	r.log.Info("relay stopped", slog.Int64("published", r.stats.published.Load()))
	if err := context.Cause(ctx); errors.Is(err, ErrMixedOwnership) {
		r.forgetOwnership()
		return err
	}
	return nil
}

// services are what Run runs beside the drainer and the listener, each on
// its goroutine until ctx ends: the reaper (reap.go: expired claims, dead
// relays) always, and the broker's own upkeep when it has some
// (broker.Maintainer: redisbroker trims its streams). (A partition owner's
// lease renewal is not one: it runs on the drainer's goroutine, between
// batches, so that a slot is never given back with a batch of it in flight.)
func (r *Relay) services() []func(context.Context) {
	run := []func(context.Context){r.reaper.run}
	if m, ok := r.broker.(broker.Maintainer); ok {
		run = append(run, m.Maintain)
	}
	return run
}

// firstListenWait bounds how long the first drain waits for the LISTEN
// connection.
const firstListenWait = 2 * time.Second

// listenAttempted ends the first drain's wait for the LISTEN connection.
func (r *Relay) listenAttempted() { r.listener.triedOnce.Do(func() { close(r.listener.tried) }) }

// kick wakes the drainer; wake-ups that arrive while it is busy coalesce into
// one more drain, so none is lost.
func (r *Relay) kick() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}
