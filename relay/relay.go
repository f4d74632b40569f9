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

	// What this relay last told writers, owned by drainLoop. notifying:
	// the idle flag is 1 (after outbox_relay_sleep), so writers notify;
	// false after outbox_relay_busy. asleep: besides, the last claim came
	// after a sleep that found no writer still in flight that had seen the
	// relay busy, so the relay may wait for a notification.
	notifying, asleep bool
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
		return nil, fmt.Errorf("relay config: %w", err)
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
	return &Relay{
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
		notifying:      true, // the start-up drain claims as if woken
		asleep:         true,
	}, nil
}

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
	r.log.Info("relay starting",
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
	retry := time.NewTimer(0)
	defer retry.Stop()
	// On the way out, tell writers to notify again: another relay may be
	// asleep, waiting for them.
	defer r.sleepOnExit()
	polled := false
	for {
		n, retryIn, err := r.drain(ctx, polled)
		if polled && n > 0 {
			r.stats.pollsWithWork.Add(1)
			if m := r.cfg.Metrics; m != nil {
				m.pollsWithWork.Inc()
			}
		}
		polled = false
		if err != nil && ctx.Err() == nil {
			r.log.Warn("drain failed; retrying", slog.Any("error", err), slog.Duration("retry_in", drainErrorRetry))
			// Writers may have stopped notifying (this relay said it was
			// busy): retry soon rather than at the next poll.
			if retryIn == 0 || retryIn > drainErrorRetry {
				retryIn = drainErrorRetry
			}
		}
		// Rows that failed become claimable again after their backoff; wake
		// up for them then rather than at the next poll.
		retry.Stop()
		if retryIn > 0 && retryIn < r.cfg.PollInterval {
			retry.Reset(retryIn)
		}
		select {
		case <-ctx.Done():
			return
		case <-r.wake:
		case <-retry.C:
		case <-poll.C:
			r.stats.polls.Add(1)
			if m := r.cfg.Metrics; m != nil {
				m.polls.Inc()
			}
			polled = true
		}
	}
}

// drainErrorRetry is how soon a drain that failed (the database unreachable,
// a statement timed out) is tried again.
const drainErrorRetry = time.Second

// flagOp is what a claim tells writers about this relay, in the same round
// trip, before it claims: see sql/migrations/0006_outbox_notify_idle.sql.
type flagOp int

const (
	flagNone  flagOp = iota
	flagBusy         // draining: writers need not notify
	flagSleep        // about to sleep: writers must notify (waits for writers that read "busy")
)

// drain publishes batches until a claim finds nothing, backing off while the
// broker is unavailable. It returns the rows published and, if some rows
// failed, how soon the earliest becomes claimable again.
//
// It does not stop at a short batch: publishing an event can make the next
// event of the same aggregate claimable, and no notification announces that.
//
// While it drains, writers are told not to notify (their NOTIFY would
// serialize their commits for nothing); before it returns, it tells them to
// notify again and claims once more, so a row committed in between is never
// left for the fallback poll. A poll re-asserts "asleep" first, in case a
// relay that crashed while draining left writers silent.
func (r *Relay) drain(ctx context.Context, polled bool) (published int, retryIn time.Duration, err error) {
	op := flagNone
	if polled {
		op = flagSleep
	}
	// A wake-up usually finds one small batch; saying "busy" and "asleep"
	// around it would cost two statements and buy nothing. Writers are told
	// to stop notifying only once a second claim in a row finds rows: the
	// relay is then draining a stream of commits.
	nonEmpty, lingered := 0, 0
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
		var res BatchResult
		res, pending, err = r.drainBatch(ctx, op, pending, true)
		if err == nil {
			switch op {
			case flagBusy:
				r.notifying, r.asleep = false, false
			case flagSleep:
				r.notifying = true
				// Not asleep yet if a writer that saw us busy is still in
				// its transaction: claim again a little later.
				r.asleep = res.Slept
			}
		}
		sent := op
		op = flagNone
		published += res.Published
		if res.RetryIn > 0 && (retryIn == 0 || res.RetryIn < retryIn) {
			retryIn = res.RetryIn
		}
		switch {
		case err != nil:
			return published, retryIn, err
		case res.BrokerDown:
			if err := flush(); err != nil {
				return published, retryIn, err
			}
			r.brokerFailures++
			d := retry.Backoff(r.brokerFailures, 100*time.Millisecond, 10*time.Second)
			r.brokerDownUntil = time.Now().Add(d)
			r.log.Warn("redis unavailable; backing off", slog.Int("released", res.Released),
				slog.Duration("retry_in", d), slog.Any("error", res.Err))
			retry.Sleep(ctx, d)
		case res.Claimed == 0 && r.asleep:
			return published, retryIn, nil
		case res.Claimed == 0 && lingered < busyLingerClaims:
			// Busy, and the claim came back empty: commits arrive in waves
			// (one per WAL flush), so wait a little for the next one before
			// asking writers to notify again. Each NOTIFY costs its writer a
			// flush of its own.
			lingered++
			retry.Sleep(ctx, busyLingerStep)
		case res.Claimed == 0:
			if sent == flagSleep {
				// The sleep found writers that saw us busy still in their
				// transactions: try again a little later.
				lingered++
				retry.Sleep(ctx, retry.Backoff(lingered-busyLingerClaims, busyLingerStep, 100*time.Millisecond))
			}
			op = flagSleep
		default:
			lingered = 0
			r.brokerFailures, r.brokerDownUntil = 0, time.Time{} // Redis took this batch
			if nonEmpty++; r.notifying && nonEmpty >= 2 {
				op = flagBusy
			}
			if !r.notifying && r.cfg.BusyPace > 0 && res.Claimed < r.cfg.BatchSize/4 {
				// Busy with a stream of small batches: let commits gather
				// rather than pay a claim, a pipeline and a mark for a few
				// rows each time (on 2 cores that work competes with the
				// writers themselves).
				retry.Sleep(ctx, r.cfg.BusyPace)
			}
		}
	}
	return published, retryIn, nil
}

// A relay that told writers it is busy claims up to busyLingerClaims more
// times, busyLingerStep apart, before it goes back to sleep.
const (
	busyLingerClaims = 3
	busyLingerStep   = 2 * time.Millisecond
)

// sleepOnExit tells writers to notify again as this relay stops.
func (r *Relay) sleepOnExit() {
	if r.notifying {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), markTimeout)
	defer cancel()
	if _, err := r.pool.Exec(ctx, r.qSleep); err != nil {
		r.log.Warn("could not tell writers to notify again; other relays rely on their poll until then",
			slog.Any("error", err))
	}
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
}

// DrainBatch claims one batch, publishes it and records the outcome. Once rows
// are claimed it finishes even if ctx is cancelled (bounded by the publish
// timeout), so a shutdown never strands a claim until the lease expires.
func (r *Relay) DrainBatch(ctx context.Context) (BatchResult, error) {
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
}

// drainBatch is DrainBatch with three more inputs: op is sent ahead of the
// claim; prev, if not nil, is marked in the claim's round trip and counted in
// the result; with deferMark, this batch's own mark of the published rows is
// returned for the next call instead of being sent.
func (r *Relay) drainBatch(ctx context.Context, op flagOp, prev *pendingMark, deferMark bool) (BatchResult, *pendingMark, error) {
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
	msgs, prevMarked, slept, err := r.claim(cctx, op, token, prev)
	if err != nil {
		if prev != nil {
			// The mark rolled back with the claim; send it on its own.
			var res BatchResult
			if merr := r.markPublished(ctx, &res, prev); merr != nil {
				err = errors.Join(err, merr)
			}
		}
		return BatchResult{}, nil, err
	}
	res := BatchResult{Slept: slept}
	if prev != nil {
		r.notePublished(&res, prev, prevMarked)
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
		streams[i] = r.cfg.streamKey(m.AggregateType)
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
		ok                  = pendingMark{token: token}
		failIDs, releaseIDs []uuid.UUID
		failErrs            []string
		failDelays          []int64
	)
	for i, m := range msgs {
		switch {
		case errs[i] == nil:
			r.noteStream(streams[i])
			ok.ids = append(ok.ids, m.ID)
			ok.streamIDs = append(ok.streamIDs, ids[i])
			r.cfg.Metrics.delay(time.Since(m.CreatedAt))
		case brokerUnavailable(errs[i]):
			res.BrokerDown = true
			res.Err = errs[i]
			releaseIDs = append(releaseIDs, m.ID)
		default:
			res.Err = errs[i]
			r.cfg.Metrics.failure(m.EventType)
			failIDs = append(failIDs, m.ID)
			failErrs = append(failErrs, truncate(errs[i].Error(), 1000))
			delay := retry.Backoff(m.Attempts+1, r.cfg.BackoffBase, r.cfg.BackoffMax)
			failDelays = append(failDelays, delay.Milliseconds())
			if res.RetryIn == 0 || delay < res.RetryIn {
				res.RetryIn = delay
			}
			r.log.Warn("publish failed", slog.String("event_id", m.ID.String()),
				slog.String("event_type", m.EventType), slog.String("aggregate_id", m.AggregateID),
				slog.Int("attempt", m.Attempts+1), slog.Any("error", errs[i]))
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
	if len(failIDs) > 0 {
		tag, err := r.exec(ctx, r.qMarkFailed, failIDs, failErrs, failDelays, token, r.cfg.MaxAttempts)
		if err != nil {
			return res, next, fmt.Errorf("record %d failed publishes: %w", len(failIDs), err)
		}
		res.Failed = int(tag.RowsAffected())
	}
	if len(releaseIDs) > 0 {
		n, err := r.release(ctx, token, releaseIDs, releaseDelay, res.Err)
		if err != nil {
			return res, next, err
		}
		res.Released = n
		res.RetryIn = releaseDelay
	}
	r.stats.failed.Add(int64(res.Failed))
	r.stats.released.Add(int64(res.Released))
	return res, next, nil
}

// markPublished sends m's mark on its own and counts it in res.
func (r *Relay) markPublished(ctx context.Context, res *BatchResult, m *pendingMark) error {
	tag, err := r.exec(ctx, r.qMarkPublished, m.ids, m.streamIDs, m.token)
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
func (r *Relay) claim(ctx context.Context, op flagOp, token uuid.UUID, prev *pendingMark) (_ []message, marked int, slept bool, _ error) {
	var (
		msgs []message
		b    pgx.Batch
	)
	b.Queue(asyncCommit)
	switch op {
	case flagBusy:
		b.Queue(r.qBusy)
	case flagSleep:
		b.Queue(r.qSleep).QueryRow(func(row pgx.Row) error { return row.Scan(&slept) })
	}
	if prev != nil {
		b.Queue(r.qMarkPublished, prev.ids, prev.streamIDs, prev.token).Exec(func(tag pgconn.CommandTag) error {
			marked = int(tag.RowsAffected())
			return nil
		})
	}
	b.Queue(r.qClaim, r.cfg.BatchSize, token, r.cfg.Name).Query(func(rows pgx.Rows) error {
		var err error
		msgs, err = pgx.CollectRows(rows, pgx.RowToStructByPos[message])
		return err
	})
	if err := r.pool.SendBatch(ctx, &b).Close(); err != nil {
		return nil, 0, false, fmt.Errorf("claim: %w", err)
	}
	return msgs, marked, slept, nil
}

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
	b.Queue(asyncCommit)
	b.Queue(sql, args...).Exec(func(t pgconn.CommandTag) error { tag = t; return nil })
	err := r.pool.SendBatch(ctx, &b).Close()
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
	_, _ = r.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, m := range msgs {
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
					"event_id", m.ID.String(),
					"event_type", m.EventType,
					"aggregate_type", m.AggregateType,
					"aggregate_id", m.AggregateID,
					"payload", m.Payload,
					"headers", headers,
					"occurred_at", m.CreatedAt.UTC().Format(time.RFC3339Nano),
					"seq", m.Seq,
				},
			})
		}
		return nil
	})
	ids := make([]string, len(msgs))
	errs := make([]error, len(msgs))
	for i, c := range cmds {
		ids[i], errs[i] = c.Result()
		if errs[i] != nil {
			spans[i].RecordError(errs[i])
			spans[i].SetStatus(codes.Error, errs[i].Error())
		}
		spans[i].End()
	}
	return ids, errs
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
	if m := r.cfg.Metrics; m != nil {
		m.reaped.Add(float64(total))
	}
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
