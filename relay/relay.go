// Package relay publishes committed outbox events to Redis Streams.
//
// A Relay listens on one dedicated PostgreSQL connection for the outbox
// trigger's NOTIFY, and drains the outbox on every notification and on a slow
// fallback poll. Draining claims a batch of rows with FOR UPDATE SKIP LOCKED
// (status publishing, claimed_at, a fresh claim token), publishes them with
// one pipelined round trip of XADDs outside any database transaction, then
// marks published only the rows its claim still owns. A reaper returns claims
// whose lease expired to pending. Any number of relays can run side by side.
//
// Delivery is at least once: a relay that dies between XADD and the mark, or
// a stale relay fenced out after its lease, leaves a duplicate in the stream.
// Consumers deduplicate on event_id.
package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/tedbank/outbox/internal/failpoint"
	"github.com/tedbank/outbox/internal/retry"
	"github.com/tedbank/outbox/internal/tracing"
	"github.com/tedbank/outbox/relay/entry"
	outboxsql "github.com/tedbank/outbox/sql"
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

// Pipeliner is what the relay needs from Redis: *redis.Client satisfies it.
type Pipeliner interface {
	Pipelined(ctx context.Context, fn func(redis.Pipeliner) error) ([]redis.Cmder, error)
}

// Relay moves events from outbox_messages to Redis Streams.
type Relay struct {
	cfg       Config
	pool      *pgxpool.Pool
	rdb       Pipeliner
	log       *slog.Logger
	listenCfg *pgx.ConnConfig
	wake      chan struct{}
	stats     counters

	streamsMu sync.Mutex
	streams   map[string]bool // streams published to, for trimming

	qClaim, qMarkPublished, qMarkFailed, qRelease, qReap string
	qBusy, qSleep                                        string

	// leases: the partition slots this relay holds, with Config.Ownership
	// OwnPartitions (partitions.go). Owned by drainLoop.
	leases leases
	// slotsFreed: another relay gave partition slots back; renew now.
	slotsFreed atomic.Bool

	// Owned by drainLoop: what this relay may assume about the writers
	// (wakeup.go), and when rows it failed become claimable again.
	state   wakeState
	retries retrySchedule
	// resync: the LISTEN connection came back; writers may have been told
	// nothing since (a PostgreSQL crash can undo the flag's last change), so
	// the next drain must say "sleep" again before waiting.
	resync atomic.Bool
	// listenNow cuts the LISTEN connection's reconnect backoff short: the
	// drainer reached the database again.
	listenNow chan struct{}
	// dbFailures counts drains in a row that failed (the database
	// unreachable, a statement timed out); dbDownSince is when the first
	// failed, dbWarned when the last warning was logged and dbRetryAt when
	// the backoff ends (polls wait for it; a notification does not).
	dbFailures                       int
	dbDownSince, dbWarned, dbRetryAt time.Time
	// brokerFailures counts batches Redis refused as a whole in a row, across
	// drains; brokerDownUntil is when the current backoff ends.
	brokerFailures  int
	brokerDownUntil time.Time
}

// Stats counts what a relay did since it started.
type Stats struct {
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
}

type counters struct {
	claimed, published, fenced, failed, released, reaped atomic.Int64
	notifications, polls, pollsWithWork                  atomic.Int64
	listenUp                                             atomic.Bool
}

// New returns a relay that claims from pool and publishes to rdb. It checks
// cfg but does not connect; Run does.
func New(pool *pgxpool.Pool, rdb Pipeliner, cfg Config) (*Relay, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	listenCfg := cfg.ListenConfig
	if listenCfg == nil {
		listenCfg = pool.Config().ConnConfig.Copy()
		app := listenCfg.RuntimeParams["application_name"]
		if app == "" {
			app = "outbox-relay"
		}
		listenCfg.RuntimeParams["application_name"] = app + "-listen"
	}
	r := &Relay{
		cfg:            cfg,
		pool:           pool,
		rdb:            rdb,
		log:            cfg.Logger.With(slog.String("relay", cfg.Name)),
		listenCfg:      listenCfg,
		wake:           make(chan struct{}, 1),
		qClaim:         outboxsql.Query("relay_claim"),
		qMarkPublished: outboxsql.Query("relay_mark_published"),
		qMarkFailed:    outboxsql.Query("relay_mark_failed"),
		qRelease:       outboxsql.Query("relay_release"),
		qReap:          outboxsql.Query("relay_reap"),
		qBusy:          outboxsql.Query("relay_busy"),
		qSleep:         outboxsql.Query("relay_sleep"),
		listenNow:      make(chan struct{}, 1),
		// A relay starting cannot know what writers were last told (a
		// relay killed while draining leaves them silent): it says
		// "sleep" before it waits for a notification.
		state:  unsure,
		leases: leases{owner: cfg.Name},
	}
	if r.ownsPartitions() {
		r.qClaim = outboxsql.Query("relay_read")
		r.qMarkPublished = outboxsql.Query("relay_mark_published_leased")
		r.qMarkFailed = outboxsql.Query("relay_mark_failed_leased")
	}
	return r, nil
}

// ownsPartitions: this relay leases partition slots rather than claiming rows.
func (r *Relay) ownsPartitions() bool { return r.cfg.Ownership == OwnPartitions }

// Ready reports why the relay cannot do its work right now, or nil: the
// database and Redis answer and the LISTEN connection is up.
func (r *Relay) Ready(ctx context.Context) error {
	if err := r.pool.Ping(ctx); err != nil {
		return fmt.Errorf("postgres: %w", err)
	}
	if _, err := r.rdb.Pipelined(ctx, func(p redis.Pipeliner) error { p.Ping(ctx); return nil }); err != nil {
		return fmt.Errorf("redis: %w", err)
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
		Claimed: s.claimed.Load(), Published: s.published.Load(), Fenced: s.fenced.Load(),
		Failed: s.failed.Load(), Released: s.released.Load(), Reaped: s.reaped.Load(),
		Notifications: s.notifications.Load(), Polls: s.polls.Load(),
		PollsWithWork: s.pollsWithWork.Load(), ListenUp: s.listenUp.Load(),
	}
}

// Run relays until ctx is cancelled, then stops claiming, finishes (or
// releases) the batch in flight and returns nil. It returns an error only if
// it cannot start.
func (r *Relay) Run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	r.log.Info("relay starting", slog.String("ownership", r.cfg.Ownership),
		slog.Int("batch", r.cfg.BatchSize), slog.Duration("lease", r.cfg.Lease),
		slog.Duration("poll", r.cfg.PollInterval), slog.String("channel", r.cfg.Channel))

	var wg sync.WaitGroup
	wg.Go(func() { r.listenLoop(ctx) })
	wg.Go(func() { r.reapLoop(ctx) })
	if t, ok := r.rdb.(Trimmer); ok && (r.cfg.StreamMaxLen > 0 || r.cfg.StreamRetention > 0) {
		wg.Go(func() { r.trimLoop(ctx, t) })
	}
	r.drainLoop(ctx)
	cancel()
	wg.Wait()
	r.log.Info("relay stopped", slog.Int64("published", r.stats.published.Load()))
	return nil
}

// kick wakes the drainer; wake-ups that arrive while it is busy coalesce into
// one more drain, so none is lost.
func (r *Relay) kick() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

func (r *Relay) drainLoop(ctx context.Context) {
	poll := time.NewTicker(r.cfg.PollInterval)
	defer poll.Stop()
	retryTimer := time.NewTimer(0)
	defer retryTimer.Stop()
	// On the way out, tell writers to notify again and wake the other
	// relays: they may be asleep, waiting for writers this relay silenced.
	defer r.sleepOnExit()
	// Before that, give back the partition leases (if any) so that the
	// relays it wakes can take them.
	defer r.leaveLeases()
	var renew <-chan time.Time // partition leases: renewals while idle
	if r.ownsPartitions() {
		t := time.NewTicker(r.leaseRenewInterval())
		defer t.Stop()
		renew = t.C
	}
	polled := false
	for {
		started := time.Now()
		n, err := r.drain(ctx, polled)
		if polled && n > 0 {
			r.stats.pollsWithWork.Add(1)
			r.cfg.Metrics.polled(true)
		}
		polled = false
		var wait time.Duration // until the next drain at the latest (0: poll)
		switch {
		case ctx.Err() != nil:
		case err != nil:
			wait = r.drainFailed(err)
		default:
			r.drainSucceeded()
			// Rows that were claimable when this drain started were claimed.
			r.retries.covered(started)
		}
		// Rows that failed become claimable again after their backoff; wake
		// up for them then rather than at the next poll.
		if at, ok := r.retries.next(); ok {
			if d := time.Until(at); wait == 0 || d < wait {
				wait = max(d, time.Millisecond)
			}
		}
		retryTimer.Stop()
		if wait > 0 && wait < r.cfg.PollInterval {
			retryTimer.Reset(wait)
		}
	wait:
		select {
		case <-ctx.Done():
			return
		case <-r.wake:
		case <-retryTimer.C:
		case <-renew:
			r.renewLeasesIfDue(ctx)
			goto wait // it kicks the drainer if it took slots
		case <-poll.C:
			if time.Now().Before(r.dbRetryAt) {
				goto wait // the database is failing: the backoff paces retries
			}
			r.stats.polls.Add(1)
			r.cfg.Metrics.polled(false)
			polled = true
		}
	}
}

// A drain that failed (the database unreachable, a statement timed out) is
// tried again after a backoff from drainRetryMin to drainRetryMax; while it
// keeps failing, a warning is logged at most every drainWarnEvery.
const (
	drainRetryMin  = 100 * time.Millisecond
	drainRetryMax  = 5 * time.Second
	drainWarnEvery = 30 * time.Second
)

// drainFailed records a failed drain and returns how soon to try again.
func (r *Relay) drainFailed(err error) time.Duration {
	now := time.Now()
	r.dbFailures++
	if r.dbFailures == 1 {
		r.dbDownSince = now
	}
	d := retry.Backoff(r.dbFailures, drainRetryMin, drainRetryMax)
	r.dbRetryAt = now.Add(d)
	if r.dbFailures == 1 || now.Sub(r.dbWarned) >= drainWarnEvery {
		r.dbWarned = now
		r.log.Warn("drain failed; retrying", slog.Any("error", err), slog.Int("attempt", r.dbFailures),
			slog.Duration("retry_in", d), slog.Duration("failing_for", now.Sub(r.dbDownSince).Round(time.Millisecond)))
	} else {
		r.log.Debug("drain failed; retrying", slog.Any("error", err), slog.Int("attempt", r.dbFailures),
			slog.Duration("retry_in", d))
	}
	return d
}

// drainSucceeded notes the end of a run of failed drains.
func (r *Relay) drainSucceeded() {
	if r.dbFailures == 0 {
		return
	}
	r.log.Info("database reachable again; draining", slog.Int("failed_attempts", r.dbFailures),
		slog.Duration("down_for", time.Since(r.dbDownSince).Round(time.Millisecond)))
	r.dbFailures, r.dbRetryAt = 0, time.Time{}
	// If the LISTEN connection is waiting out its backoff, reconnect now:
	// until it is back, only this relay's poll finds new rows.
	select {
	case r.listenNow <- struct{}{}:
	default:
	}
}

// flagOp is what a claim tells writers about this relay, in the same round
// trip, before it claims: see sql/migrations/0006_outbox_notify_idle.sql.
type flagOp int

const (
	flagNone  flagOp = iota
	flagBusy         // draining: writers need not notify
	flagSleep        // about to sleep: writers must notify (waits for writers that read "busy")
)

// drain publishes batches until a claim finds nothing, backing off while the
// broker is unavailable, and returns the rows published.
//
// It does not stop at a short batch: publishing an event can make the next
// event of the same aggregate claimable, and no notification announces that.
//
// While it drains, writers are told not to notify (their NOTIFY would
// serialize their commits for nothing); before it returns, it tells them to
// notify again and claims once more, so a row committed in between is never
// left for the fallback poll (wakeup.go). A poll re-asserts "sleep" first, in
// case a relay that crashed while draining left writers silent.
func (r *Relay) drain(ctx context.Context, polled bool) (published int, err error) {
	if r.resync.Swap(false) {
		r.setState(unsure)
	}
	op := flagNone
	if polled {
		op = flagSleep
	}
	// A wake-up usually finds one small batch; saying "busy" and "asleep"
	// around it would cost two statements and buy nothing. Writers are told
	// to stop notifying only once a second claim in a row finds rows: the
	// relay is then draining a stream of commits.
	nonEmpty, lingered, sleepTries := 0, 0, 0
	// Redis refused the last batch as a whole: wait out the backoff before
	// the first claim, even if a notification woke this drain early, so that
	// an outage costs one publish round per backoff step, not one per commit.
	if wait := time.Until(r.brokerDownUntil); wait > 0 {
		retry.Sleep(ctx, wait)
	}
	var pending *pendingMark // the last batch's mark, sent with the next claim
	flush := func() error {  // sends it on its own
		if pending == nil {
			return nil
		}
		var res BatchResult
		mctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), markTimeout)
		defer cancel()
		err := r.markPublished(mctx, &res, pending)
		pending = nil
		published += res.Published
		return err
	}
	defer func() {
		if ferr := flush(); ferr != nil {
			err = errors.Join(err, ferr)
		}
	}()
	for ctx.Err() == nil {
		if r.leaseRenewalDue() {
			// The last batch's mark goes first: a slot given back with
			// its mark unsent would leave its rows to be published twice.
			if err := flush(); err != nil {
				return published, err
			}
			r.renewLeasesIfDue(ctx)
		}
		var res BatchResult
		res, pending, err = r.drainBatch(ctx, op, pending, true)
		if err != nil {
			// The round trip may have told writers "busy" before it failed
			// (the flag is a sequence: its change is not rolled back), or a
			// later step failed after it did: they may be silent.
			r.setState(unsure)
		} else {
			r.setState(r.state.after(op, res.Slept))
		}
		now := time.Now()
		for _, d := range res.retries {
			r.retries.add(now.Add(d))
		}
		sent := op
		op = flagNone
		published += res.Published
		switch {
		case err != nil:
			return published, err
		case res.BrokerDown:
			if err := flush(); err != nil {
				return published, err
			}
			r.brokerFailures++
			d := retry.Backoff(r.brokerFailures, 100*time.Millisecond, 10*time.Second)
			r.brokerDownUntil = time.Now().Add(d)
			level := slog.LevelDebug
			if r.brokerFailures == 1 || r.brokerFailures%20 == 0 {
				level = slog.LevelWarn
			}
			r.log.Log(ctx, level, "redis unavailable; backing off", slog.Int("released", res.Released),
				slog.Int("attempt", r.brokerFailures), slog.Duration("retry_in", d), slog.Any("error", res.Err))
			retry.Sleep(ctx, d)
		case res.Claimed == 0 && r.state == asleep:
			return published, nil
		case res.Claimed == 0 && r.state == saidBusy && lingered < busyLingerClaims:
			// Busy, and the claim came back empty: commits arrive in waves
			// (one per WAL flush), so wait a little for the next one before
			// asking writers to notify again. Each NOTIFY costs its writer a
			// flush of its own.
			lingered++
			retry.Sleep(ctx, busyLingerStep)
		case res.Claimed == 0:
			if sent == flagSleep {
				// The sleep found writers that saw us busy still in their
				// transactions: try again a little later, or at once if a
				// notification comes (writers that read "sleep" send one).
				sleepTries++
				r.pause(ctx, retry.Backoff(sleepTries, busyLingerStep, 100*time.Millisecond))
			}
			op = flagSleep
		default:
			lingered = 0
			if r.brokerFailures > 0 {
				r.log.Info("redis available again; publishing", slog.Int("refused_rounds", r.brokerFailures))
			}
			r.brokerFailures, r.brokerDownUntil = 0, time.Time{} // Redis took this batch
			if nonEmpty++; r.state != saidBusy && nonEmpty >= 2 {
				op = flagBusy
			}
			if r.state == saidBusy && r.cfg.BusyPace > 0 && res.Claimed < r.cfg.BatchSize/4 {
				// Busy with a stream of small batches: let commits gather
				// rather than pay a claim, a pipeline and a mark for a few
				// rows each time (on 2 cores that work competes with the
				// writers themselves).
				retry.Sleep(ctx, r.cfg.BusyPace)
			}
		}
	}
	return published, nil
}

// setState moves the wake-up state, with a debug line per change: the
// chaos suite reads them to hold a writer open while this relay is the only
// one that told writers it is busy (internal/chaos, rolling deploys).
func (r *Relay) setState(s wakeState) {
	if s == r.state {
		return
	}
	r.state = s
	r.log.Debug("wake state", slog.String("state", s.String()))
}

// pause waits for d, or less if a notification arrives (it is consumed: the
// caller claims next).
func (r *Relay) pause(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	case <-r.wake:
	}
}

// A relay that told writers it is busy claims up to busyLingerClaims more
// times, busyLingerStep apart, before it goes back to sleep.
const (
	busyLingerClaims = 3
	busyLingerStep   = 2 * time.Millisecond
)

// exitWait bounds how long a stopping relay waits for the writers that saw
// it busy.
const exitWait = 3 * time.Second

// sleepOnExit is a stopping relay's last word. Unless it is asleep, writers
// may be silent because of it, and some that read "busy" may still be in
// their transactions: their rows would wake nobody. So it tells writers to
// notify again, waits for those writers (exitWait at most), and wakes the
// other relays with a NOTIFY sent when that wait is over.
func (r *Relay) sleepOnExit() {
	if r.state == asleep {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), exitWait)
	defer cancel()
	for attempt := 1; ; attempt++ {
		slept, err := r.sayGoodbye(ctx)
		switch {
		case err != nil:
			r.log.Warn("could not wake the other relays on the way out; they rely on their poll until then",
				slog.Any("error", err))
			return
		case slept:
			return
		case ctx.Err() != nil:
			r.log.Warn("writers that saw this relay busy are still in their transactions; other relays find their rows at their poll")
			return
		}
		retry.Sleep(ctx, retry.Backoff(attempt, busyLingerStep, 100*time.Millisecond))
	}
}

// sayGoodbye runs outbox_relay_sleep and a NOTIFY in one transaction: the
// notification goes out when the writers that saw this relay busy have
// finished (or the lock wait gave up; then slept is false).
func (r *Relay) sayGoodbye(ctx context.Context) (slept bool, _ error) {
	var b pgx.Batch
	queueRelayTx(&b)
	b.Queue(r.qSleep).QueryRow(func(row pgx.Row) error { return row.Scan(&slept) })
	b.Queue("SELECT pg_notify($1, '')", r.cfg.Channel)
	if err := r.sendTx(ctx, &b); err != nil {
		return false, err
	}
	return slept, nil
}

// BatchResult says what one DrainBatch did.
type BatchResult struct {
	Claimed    int   // rows claimed
	Published  int   // rows marked published
	Fenced     int   // rows published but no longer owned by this claim
	Failed     int   // rows that failed (retry later, or dead)
	Released   int   // rows given back without an attempt
	BrokerDown bool  // Redis refused the batch as a whole
	Err        error // the publish error behind Failed or BrokerDown, if any
	// RetryIn is how soon the earliest failed or released row becomes
	// claimable again (0 if none).
	RetryIn time.Duration
	// retries: how soon each failed or released row becomes claimable again
	// (distinct delays only).
	retries []time.Duration
	// Slept: the claim was preceded by outbox_relay_sleep, which found no
	// writer left that had seen the relay busy.
	Slept bool
}

// message is one claimed outbox row.
type message struct {
	ID            uuid.UUID
	Seq           int64
	AggregateType string
	AggregateID   string
	EventType     string
	Payload       []byte
	Headers       []byte
	Attempts      int
	CreatedAt     time.Time
	PartitionKey  string
}

// DrainBatch claims one batch, publishes it and records the outcome. Once rows
// are claimed it finishes even if ctx is cancelled (bounded by the publish
// timeout), so a shutdown never strands a claim until the lease expires.
// With partition leases it first renews them when due (it must not be
// called while Run runs).
func (r *Relay) DrainBatch(ctx context.Context) (BatchResult, error) {
	r.renewLeasesIfDue(ctx) // with partition leases: take or renew this relay's share
	res, _, err := r.drainBatch(ctx, flagNone, nil, false)
	return res, err
}

// pendingMark is a published batch whose mark has not been sent yet: while
// draining, it rides in the next claim's round trip (one round trip and one
// commit per batch instead of two).
type pendingMark struct {
	ids       []uuid.UUID
	streamIDs []string
	token     uuid.UUID
	// With partition leases: each row's seq, slot and the lease token it
	// was read under (token is then unused).
	seqs   []int64
	slots  []int32
	tokens []uuid.UUID
}

// add records one published row.
func (m *pendingMark) add(id uuid.UUID, seq int64, streamID string, l rowLease) {
	m.ids = append(m.ids, id)
	m.seqs = append(m.seqs, seq)
	m.streamIDs = append(m.streamIDs, streamID)
	m.slots = append(m.slots, l.slot)
	m.tokens = append(m.tokens, l.token)
}

// args are relay_mark_published's arguments, or with partition leases
// relay_mark_published_leased's.
func (m *pendingMark) args(leased bool) []any {
	if leased {
		return []any{m.ids, m.streamIDs, m.slots, m.tokens}
	}
	return []any{m.ids, m.streamIDs, m.token}
}

// drainBatch is DrainBatch with three more inputs: op is sent ahead of the
// claim; prev, if not nil, is marked in the claim's round trip and counted in
// the result; with deferMark, this batch's own mark of the published rows is
// returned for the next call instead of being sent.
func (r *Relay) drainBatch(ctx context.Context, op flagOp, prev *pendingMark, deferMark bool) (BatchResult, *pendingMark, error) {
	if !r.ownsPartitions() || prev == nil {
		return r.drainOne(ctx, op, prev, nil, deferMark)
	}
	// With partition leases the last batch's mark, the costliest statement
	// (a non-HOT update per row), runs on a connection of its own while this
	// batch is read and published: the read leaves the last batch's rows
	// out, and may take the next event of their keys, which is published
	// after them. (A batch whose publishes failed records that before it
	// returns, so the read already sees those rows waiting for their retry.)
	join := r.markAsync(ctx, prev)
	res, next, err := r.drainOne(ctx, op, nil, prev.seqs, deferMark)
	var prevRes BatchResult
	if merr := join(&prevRes); merr != nil {
		err = errors.Join(err, merr)
	}
	res.Published += prevRes.Published
	res.Fenced += prevRes.Fenced
	return res, next, err
}

// markAsync sends m's mark on its own connection; the returned function
// waits for it and counts it in res.
func (r *Relay) markAsync(ctx context.Context, m *pendingMark) func(res *BatchResult) error {
	done := make(chan struct{})
	var (
		res BatchResult
		err error
	)
	go func() {
		defer close(done)
		mctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), markTimeout)
		defer cancel()
		err = r.markPublished(mctx, &res, m)
	}()
	return func(into *BatchResult) error {
		<-done
		*into = res
		return err
	}
}

// drainOne is drainBatch in one piece: it also leaves out of its claim the
// rows of seqs (a batch whose mark is in flight).
func (r *Relay) drainOne(ctx context.Context, op flagOp, prev *pendingMark, exclude []int64, deferMark bool) (BatchResult, *pendingMark, error) {
	if err := ctx.Err(); err != nil {
		return BatchResult{}, prev, err
	}
	// Past this point the batch is finished even if ctx is cancelled: a claim
	// interrupted after the server committed it would strand rows until the
	// lease expires. Every step has its own deadline instead.
	ctx = context.WithoutCancel(ctx)
	started := time.Now()
	token := uuid.New()
	cctx, cancel := context.WithTimeout(ctx, claimTimeout)
	defer cancel()
	msgs, prevMarked, slept, err := r.claim(cctx, op, token, prev, exclude)
	if err != nil {
		if prev != nil {
			// The mark rolled back with the claim; send it on its own, with
			// a deadline of its own (a hung statement or a half-open
			// connection must not freeze the relay).
			var res BatchResult
			mctx, cancel := context.WithTimeout(ctx, markTimeout)
			defer cancel()
			if merr := r.markPublished(mctx, &res, prev); merr != nil {
				err = errors.Join(err, merr)
			}
		}
		return BatchResult{}, nil, err
	}
	res := BatchResult{Slept: slept}
	if prev != nil {
		r.notePublished(&res, prev, prevMarked)
	}
	var rowLeases []rowLease // with partition leases: each row's slot and token
	if r.ownsPartitions() {
		msgs = firstOfEachKey(msgs)
		rowLeases = make([]rowLease, len(msgs))
		for i, m := range msgs {
			rowLeases[i] = r.leaseOf(m)
		}
	}
	res.Claimed = len(msgs)
	if len(msgs) == 0 {
		return res, nil, nil
	}
	defer func() { r.cfg.Metrics.batch(res, time.Since(started)) }()
	r.stats.claimed.Add(int64(len(msgs)))
	if r.cfg.OnClaim != nil {
		r.cfg.OnClaim(messageIDs(msgs))
	}
	failpoint.Inject("relay.after-claim")

	streams := make([]string, len(msgs))
	for i, m := range msgs {
		streams[i] = r.cfg.streamKey(m.AggregateType, m.PartitionKey)
	}
	ids, errs := r.publish(ctx, msgs, streams)
	failpoint.Inject("relay.after-xadd")
	if pipelineDown(errs, streams) {
		// Every command failed the same way: the broker, not the events.
		for i := range errs {
			errs[i] = fmt.Errorf("%w: %w", errBrokerDown, errs[i])
		}
	}

	var (
		ok         = pendingMark{token: token}
		failed     = pendingMark{token: token} // streamIDs: the errors
		releaseIDs []uuid.UUID
		failDelays []int64
	)
	leaseOf := func(i int) rowLease {
		if rowLeases == nil {
			return rowLease{}
		}
		return rowLeases[i]
	}
	for i, m := range msgs {
		switch {
		case errs[i] == nil:
			r.noteStream(streams[i])
			ok.add(m.ID, m.Seq, ids[i], leaseOf(i))
			r.cfg.Metrics.delay(time.Since(m.CreatedAt))
		case brokerUnavailable(errs[i]):
			res.BrokerDown = true
			res.Err = errs[i]
			releaseIDs = append(releaseIDs, m.ID)
		default:
			res.Err = errs[i]
			r.cfg.Metrics.failure(m.EventType)
			failed.add(m.ID, m.Seq, truncate(errs[i].Error(), 1000), leaseOf(i))
			delay := retry.Backoff(m.Attempts+1, r.cfg.BackoffBase, r.cfg.BackoffMax)
			failDelays = append(failDelays, delay.Milliseconds())
			if res.RetryIn == 0 || delay < res.RetryIn {
				res.RetryIn = delay
			}
			if !slices.Contains(res.retries, delay) {
				res.retries = append(res.retries, delay)
			}
			r.log.Warn("publish failed", slog.String("event_id", m.ID.String()),
				slog.String("event_type", m.EventType), slog.String("aggregate_id", m.AggregateID),
				slog.Int("attempt", m.Attempts+1), slog.Int("max_attempts", r.cfg.MaxAttempts), slog.Any("error", errs[i]))
		}
	}

	if r.cfg.OnPublish != nil && len(ok.ids) > 0 {
		r.cfg.OnPublish(ok.ids)
	}

	// The marks are fenced by the claim token: if our lease expired and another
	// relay re-claimed a row, the row is left to that relay.
	ctx, cancel = context.WithTimeout(ctx, markTimeout)
	defer cancel()
	var next *pendingMark
	if len(ok.ids) > 0 {
		if deferMark {
			next = &ok
		} else if err := r.markPublished(ctx, &res, &ok); err != nil {
			return res, nil, err
		}
	}
	if len(failed.ids) > 0 {
		n, err := r.markFailed(ctx, &failed, failDelays)
		if err != nil {
			return res, next, fmt.Errorf("record %d failed publishes: %w", len(failed.ids), err)
		}
		res.Failed = n
	}
	if len(releaseIDs) > 0 && r.ownsPartitions() {
		// Nothing to give back: the rows were only read, and stay
		// pending for this relay's next read.
		res.Released = len(releaseIDs)
		res.RetryIn = releaseDelay
		res.retries = append(res.retries, releaseDelay)
	} else if len(releaseIDs) > 0 {
		n, err := r.release(ctx, token, releaseIDs, releaseDelay, res.Err)
		if err != nil {
			return res, next, err
		}
		res.Released = n
		res.RetryIn = releaseDelay
		res.retries = append(res.retries, releaseDelay)
	}
	r.stats.failed.Add(int64(res.Failed))
	r.stats.released.Add(int64(res.Released))
	return res, next, nil
}

// failedRow is a row relay_mark_failed updated.
type failedRow struct {
	ID            uuid.UUID
	Attempts      int
	EventType     string
	AggregateType string
	AggregateID   string
	LastError     string
	Dead          bool
}

// markFailed records failed publishes of rows the claim token still owns and
// reports each row that went dead at ERROR: it will not be published again
// until an operator retries it (outbox dead retry), and the events of its
// aggregate after it wait for that.
func (r *Relay) markFailed(ctx context.Context, f *pendingMark, delays []int64) (int, error) {
	var (
		b    pgx.Batch
		rows []failedRow
		args = []any{f.ids, f.streamIDs, delays, f.token, r.cfg.MaxAttempts}
	)
	if r.ownsPartitions() {
		args = []any{f.ids, f.streamIDs, delays, f.slots, f.tokens, r.cfg.MaxAttempts}
	}
	queueRelayTx(&b)
	b.Queue(r.qMarkFailed, args...).Query(func(rs pgx.Rows) error {
		var err error
		rows, err = pgx.CollectRows(rs, pgx.RowToStructByPos[failedRow])
		return err
	})
	if err := r.sendTx(ctx, &b); err != nil {
		return 0, err
	}
	for _, row := range rows {
		if row.Dead {
			r.log.Error("event dead: not published after max_attempts; retry it with 'outbox dead retry'",
				slog.String("event_id", row.ID.String()), slog.String("event_type", row.EventType),
				slog.String("aggregate_type", row.AggregateType), slog.String("aggregate_id", row.AggregateID),
				slog.Int("attempts", row.Attempts), slog.Int("max_attempts", r.cfg.MaxAttempts),
				slog.String("last_error", row.LastError))
		}
	}
	return len(rows), nil
}

// markPublished sends m's mark on its own and counts it in res.
func (r *Relay) markPublished(ctx context.Context, res *BatchResult, m *pendingMark) error {
	tag, err := r.exec(ctx, r.qMarkPublished, m.args(r.ownsPartitions())...)
	if err != nil {
		return fmt.Errorf("mark %d rows published: %w", len(m.ids), err)
	}
	r.notePublished(res, m, int(tag.RowsAffected()))
	return nil
}

// notePublished counts a mark that updated n of m's rows; the others were
// re-claimed by another relay after our lease expired (fenced).
func (r *Relay) notePublished(res *BatchResult, m *pendingMark, n int) {
	fenced := len(m.ids) - n
	res.Published += n
	res.Fenced += fenced
	r.stats.published.Add(int64(n))
	r.stats.fenced.Add(int64(fenced))
	r.cfg.Metrics.marked(n, fenced)
	if fenced > 0 {
		r.log.Warn("claim lost to another relay after publishing (lease expired); duplicates left for consumers to skip",
			slog.Int("rows", fenced))
	}
}

// claim claims one batch under token. In the same round trip it first tells
// writers what op says and marks prev published (it returns how many of
// prev's rows that mark updated).
func (r *Relay) claim(ctx context.Context, op flagOp, token uuid.UUID, prev *pendingMark, exclude []int64) (_ []message, marked int, slept bool, _ error) {
	var (
		msgs []message
		b    pgx.Batch
	)
	queueRelayTx(&b)
	var injected error
	if op == flagBusy {
		injected = failpoint.Error("relay.after-busy")
	}
	if injected != nil {
		// Crash tests: a slow round trip (a pool wait, a lock) that says
		// "busy" late and then fails, as a terminated backend would make
		// it. The flag stays 0 (a sequence); the mark and claim roll back.
		b.Queue("SELECT pg_sleep(0.3)")
	}
	switch op {
	case flagBusy:
		b.Queue(r.qBusy)
	case flagSleep:
		b.Queue(r.qSleep).QueryRow(func(row pgx.Row) error { return row.Scan(&slept) })
	}
	if r.ownsPartitions() && (op != flagNone || r.state == saidBusy) {
		// Writers are silent while any relay is busy, but this relay
		// drains only its own slots: wake the others at every batch while
		// busy, and when it says "sleep" (delivered at commit, after the
		// writers that saw it busy: their rows may be in other slots).
		b.Queue("SELECT pg_notify($1, $2)", r.cfg.Channel, r.wakePayload())
	}
	if prev != nil {
		b.Queue(r.qMarkPublished, prev.args(r.ownsPartitions())...).Exec(func(tag pgconn.CommandTag) error {
			marked = int(tag.RowsAffected())
			return nil
		})
	}
	b.Queue(indexedClaim)
	args := []any{r.cfg.BatchSize, token, r.cfg.Name}
	if r.ownsPartitions() {
		args = []any{r.cfg.BatchSize, r.leases.slots, r.usableSlots(), append([]int64{}, exclude...)}
	}
	b.Queue(r.qClaim, args...).Query(func(rows pgx.Rows) error {
		var err error
		msgs, err = pgx.CollectRows(rows, pgx.RowToStructByPos[message])
		return err
	})
	if injected != nil {
		b.Queue("SELECT $1::text::int", injected.Error())
	}
	if err := r.sendTx(ctx, &b); err != nil {
		return nil, 0, false, fmt.Errorf("claim: %w", err)
	}
	return msgs, marked, slept, nil
}

// queueRelayTx queues the statements that open every relay transaction:
// beginReadCommitted, then asyncCommit. sendTx closes it.
func queueRelayTx(b *pgx.Batch) {
	b.Queue(beginReadCommitted)
	b.Queue(asyncCommit)
}

// sendTx commits the transaction queueRelayTx opened and sends the batch in
// one round trip. When a statement fails, the rest (the COMMIT included) is
// skipped and the transaction rolls back; the connection, left in a failed
// transaction block, is closed by the pool when it is released.
func (r *Relay) sendTx(ctx context.Context, b *pgx.Batch) error {
	b.Queue("COMMIT")
	return r.pool.SendBatch(ctx, b).Close()
}

// indexedClaim keeps the claim on its partial indexes whatever the table's
// statistics say. Statistics taken while the outbox was empty (a new
// database, or an idle outbox: the usual state) estimate one pending row, and
// the planner then probes the per-aggregate gate with a sequential scan per
// pending row: with a backlog of thousands, one claim took 10 s of CPU (found
// by outbox bench writers on fresh databases; after an outage, the backlog
// is exactly when the claim must be fast). Transaction-local.
const indexedClaim = "SELECT set_config('enable_seqscan', 'off', true)"

// beginReadCommitted: the wake-up protocol needs READ COMMITTED, whatever the
// database's or role's default_transaction_isolation. The claim after
// outbox_relay_sleep must see the rows of writers that committed while it
// waited for them; under REPEATABLE READ or SERIALIZABLE its snapshot would
// date from before the wait. (Claims under those levels would also fail with
// serialization errors against other relays.) An explicit transaction block:
// SET TRANSACTION in the implicit transaction of a pipeline works too, but
// PostgreSQL logs a WARNING for each one, one per relay round trip (found
// in the server log after a benchmark: 52,000 lines). It costs no round
// trip, being queued in the batch with its COMMIT (sendTx).
const beginReadCommitted = "BEGIN ISOLATION LEVEL READ COMMITTED"

// asyncCommit makes the relay's own transactions commit without waiting for
// their WAL to reach disk (set_config(..., true) lasts for the transaction).
// Safe because every relay write can be lost and redone: a claim, mark,
// release or reap that a database crash forgets leaves the row publishing or
// pending, so it is published again (a duplicate, which consumers skip). It
// never touches the writers' transactions, which stay as durable as the
// server makes them; and a later durable commit flushes these first, as WAL
// is written in order. It takes a round trip's WAL flush off every claim, the
// step between commit and stream on the latency path.
const asyncCommit = "SELECT set_config('synchronous_commit', 'off', true)"

// exec runs one relay write with asyncCommit, in one round trip.
func (r *Relay) exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	var (
		b   pgx.Batch
		tag pgconn.CommandTag
	)
	queueRelayTx(&b)
	b.Queue(sql, args...).Exec(func(t pgconn.CommandTag) error { tag = t; return nil })
	err := r.sendTx(ctx, &b)
	return tag, err
}

// release gives rows back to pending without counting an attempt.
func (r *Relay) release(ctx context.Context, token uuid.UUID, ids []uuid.UUID, after time.Duration, cause error) (int, error) {
	reason := "released"
	if cause != nil {
		reason = truncate("released: "+cause.Error(), 1000)
	}
	tag, err := r.exec(ctx, r.qRelease, ids, token, after.Milliseconds(), reason)
	if err != nil {
		return 0, fmt.Errorf("release %d rows: %w", len(ids), err)
	}
	return int(tag.RowsAffected()), nil
}

// publish XADDs msgs (msgs[i] to streams[i]) in one pipeline, in claim (seq) order, and returns each
// message's stream entry id or error.
func (r *Relay) publish(ctx context.Context, msgs []message, streams []string) ([]string, []error) {
	ctx, cancel := context.WithTimeout(ctx, r.cfg.PublishTimeout)
	defer cancel()
	cmds := make([]*redis.StringCmd, len(msgs))
	spans := make([]trace.Span, len(msgs))
	unconfirmed := make([]error, len(msgs))
	if cc, ok := r.rdb.(*redis.ClusterClient); ok && r.cfg.MinReplicas > 0 {
		// WAIT counts the replicas that have the writes of its own
		// connection, on one node: pipeline each master's share on a
		// connection to that master, the masters side by side.
		var wg sync.WaitGroup
		for node, idx := range r.byMaster(ctx, cc, streams, unconfirmed) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r.publishOn(ctx, node, idx, msgs, streams, cmds, spans, unconfirmed)
			}()
		}
		wg.Wait()
	} else {
		all := make([]int, len(msgs))
		for i := range all {
			all[i] = i
		}
		r.publishOn(ctx, r.rdb, all, msgs, streams, cmds, spans, unconfirmed)
	}
	ids := make([]string, len(msgs))
	errs := make([]error, len(msgs))
	for i, c := range cmds {
		if c == nil { // its master could not be found
			errs[i] = unconfirmed[i]
			continue
		}
		ids[i], errs[i] = c.Result()
		if errs[i] == nil && unconfirmed[i] != nil {
			errs[i] = unconfirmed[i]
		}
		if errs[i] != nil {
			spans[i].RecordError(errs[i])
			spans[i].SetStatus(codes.Error, errs[i].Error())
		}
		spans[i].End()
	}
	if cc, ok := r.rdb.(*redis.ClusterClient); ok && slices.ContainsFunc(errs, movedSlot) {
		cc.ReloadState(ctx) // a slot moved under a master's own connection
	}
	return ids, errs
}

// byMaster groups the indexes of streams by the master node serving each
// stream's slot. An index whose master cannot be found gets its error in
// errs and no group.
func (r *Relay) byMaster(ctx context.Context, cc *redis.ClusterClient, streams []string, errs []error) map[Pipeliner][]int {
	groups := map[Pipeliner][]int{}
	nodes := map[string]*redis.Client{}
	for i, s := range streams {
		node, ok := nodes[s]
		if !ok {
			var err error
			if node, err = cc.MasterForKey(ctx, s); err != nil {
				errs[i] = fmt.Errorf("%w: find the master of %s: %w", errBrokerDown, s, err)
				continue
			}
			nodes[s] = node
		}
		groups[node] = append(groups[node], i)
	}
	return groups
}

// publishOn XADDs the messages idx in one pipeline on rdb, followed, when
// Config.MinReplicas is set, by a WAIT on the same connection; it fills cmds
// and spans, and unconfirmed for each entry the replicas did not confirm.
func (r *Relay) publishOn(ctx context.Context, rdb Pipeliner, idx []int, msgs []message, streams []string,
	cmds []*redis.StringCmd, spans []trace.Span, unconfirmed []error) {
	var wait *redis.Cmd
	_, _ = rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, i := range idx {
			m := msgs[i]
			// Continue the writer's trace; the entry carries this span on.
			sctx, span := tracer.Start(tracing.ExtractJSON(ctx, m.Headers), "outbox.publish",
				trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(
					attribute.String("messaging.system", "redis"),
					attribute.String("messaging.destination.name", streams[i]),
					attribute.String("messaging.message.id", m.ID.String()),
					attribute.String("outbox.event_type", m.EventType)))
			spans[i] = span
			headers := m.Headers
			if span.IsRecording() {
				headers = tracing.ReplaceJSON(sctx, headers)
			}
			cmds[i] = p.XAdd(ctx, &redis.XAddArgs{
				Stream: streams[i],
				Values: []any{
					entry.EventID, m.ID.String(),
					entry.EventType, m.EventType,
					entry.AggregateType, m.AggregateType,
					entry.AggregateID, m.AggregateID,
					entry.Payload, m.Payload,
					entry.Headers, headers,
					entry.OccurredAt, m.CreatedAt.UTC().Format(time.RFC3339Nano),
					entry.Seq, m.Seq,
				},
			})
		}
		if r.cfg.MinReplicas > 0 {
			// On the pipeline's connection: WAIT counts the replicas that
			// have every write this connection made.
			wait = p.Do(ctx, "wait", r.cfg.MinReplicas, r.cfg.ReplicaTimeout.Milliseconds())
		}
		return nil
	})
	if wait == nil {
		return
	}
	var err error
	if n, werr := wait.Int64(); werr != nil {
		err = fmt.Errorf("%w: %w: %w", errBrokerDown, errNotReplicated, werr)
	} else if n < int64(r.cfg.MinReplicas) {
		err = fmt.Errorf("%w: %w: %d of %d replicas within %s", errBrokerDown, errNotReplicated, n, r.cfg.MinReplicas, r.cfg.ReplicaTimeout)
	}
	for _, i := range idx {
		unconfirmed[i] = err
	}
}

// Reap returns expired claims to pending and reports how many it returned.
func (r *Relay) Reap(ctx context.Context) (int, error) {
	total := 0
	for {
		// Bounded: a half-open connection must not hang the reaper (and
		// with it the relay's shutdown) until TCP gives up.
		sctx, cancel := context.WithTimeout(ctx, claimTimeout)
		tag, err := r.exec(sctx, r.qReap, r.cfg.Lease.Milliseconds(), r.cfg.BatchSize, r.cfg.MaxAttempts)
		cancel()
		if err != nil {
			return total, fmt.Errorf("reap: %w", err)
		}
		n := int(tag.RowsAffected())
		total += n
		if n < r.cfg.BatchSize {
			break
		}
	}
	r.stats.reaped.Add(int64(total))
	r.cfg.Metrics.reapedRows(total)
	return total, nil
}

func (r *Relay) reapLoop(ctx context.Context) {
	t := time.NewTicker(r.cfg.ReapInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n, err := r.Reap(ctx)
		switch {
		case err != nil && ctx.Err() == nil:
			r.log.Warn("reaper failed", slog.Any("error", err))
		case n > 0:
			r.log.Warn("returned expired claims to pending", slog.Int("rows", n))
			r.kick()
		}
	}
}

func messageIDs(msgs []message) []uuid.UUID {
	ids := make([]uuid.UUID, len(msgs))
	for i, m := range msgs {
		ids[i] = m.ID
	}
	return ids
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}

var errListenerClosed = errors.New("listen connection closed")
