package relay

import (
	"context"
	"log/slog"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tedbank/outbox/internal/queries"
	"github.com/tedbank/outbox/internal/retry"
)

// The wake-up protocol, relay side (sql/migrations/0006_outbox_notify_idle.sql
// has the writers' side). Writers notify only while the idle flag is 1. A
// relay draining a stream of commits sets it to 0 ("busy") so that writers
// stop paying for a NOTIFY each; before it waits for a notification again it
// sets it back to 1 ("sleep"), waits for the writers that read 0 to finish,
// and claims once more.
//
// wakeState is what this relay may assume about the flag and the writers.
// Its one rule: the relay waits for a notification only in state asleep.
// Whenever it cannot know what writers were told (it just started, a round
// trip that may have carried a word failed, the LISTEN connection came back
// after PostgreSQL may have crashed and undone an asynchronous change of the
// flag), it is unsure, which makes it say "sleep" at its next empty claim
// before it waits.
type wakeState int

const (
	// unsure: writers may be silent, or not. Say "sleep" at the first
	// empty claim.
	unsure wakeState = iota
	// saidBusy: this relay told writers it is draining (the flag is 0).
	// It keeps claiming, lingers a little on an empty claim (commits come
	// in waves), and must say "sleep" before it waits.
	saidBusy
	// sleepPending: the flag is 1 but writers that read 0 may still be in
	// their transactions; their rows will wake nobody. Claim again a little
	// later, after another "sleep" that finds none of them.
	sleepPending
	// asleep: the flag is 1 and the last claim came after every writer that
	// had read 0 finished: any row committed later is announced by a NOTIFY.
	asleep
)

func (s wakeState) String() string {
	switch s {
	case unsure:
		return "unsure"
	case saidBusy:
		return "busy"
	case sleepPending:
		return "sleep-pending"
	case asleep:
		return "asleep"
	}
	return "unknown"
}

// notifying: the flag is 1, so writers notify.
func (s wakeState) notifying() bool { return s == sleepPending || s == asleep }

// after is the state once a round trip that carried op succeeded; slept is
// what its outbox_relay_sleep returned.
func (s wakeState) after(op flagOp, slept bool) wakeState {
	switch op {
	case flagBusy:
		return saidBusy
	case flagSleep:
		if slept {
			return asleep
		}
		return sleepPending
	}
	return s
}

// retrySchedule holds when rows this relay failed or released become
// claimable again, so that it drains then rather than at the next poll. A
// drain that starts after a time has passed covers it; a notification that
// starts a drain earlier does not, so the times are kept until then.
type retrySchedule struct {
	at []time.Time // ascending
}

// maxScheduled bounds the schedule; rows beyond it are left to the poll.
const maxScheduled = 256

// retryGrain merges retry times closer than this into one wake-up.
const retryGrain = 5 * time.Millisecond

func (q *retrySchedule) add(t time.Time) {
	i, _ := slices.BinarySearchFunc(q.at, t, func(a, b time.Time) int { return a.Compare(b) })
	if i < len(q.at) && q.at[i].Sub(t) < retryGrain {
		return // a wake-up just after t covers it
	}
	if i > 0 && t.Sub(q.at[i-1]) < retryGrain {
		q.at[i-1] = t // move the earlier wake-up to t, so it covers both
		return
	}
	if len(q.at) >= maxScheduled {
		if i == len(q.at) {
			return
		}
		q.at = q.at[:len(q.at)-1]
	}
	q.at = slices.Insert(q.at, i, t)
}

// covered drops the times a drain that started at start has covered.
func (q *retrySchedule) covered(start time.Time) {
	i := 0
	for i < len(q.at) && !q.at[i].After(start) {
		i++
	}
	q.at = q.at[i:]
}

// next is the earliest time, if any.
func (q *retrySchedule) next() (time.Time, bool) {
	if len(q.at) == 0 {
		return time.Time{}, false
	}
	return q.at[0], true
}

// flagOp is what a claim tells writers about this relay, in the same round
// trip, before it claims: see sql/migrations/0006_outbox_notify_idle.sql.
type flagOp int

const (
	flagNone  flagOp = iota
	flagBusy         // draining: writers need not notify
	flagSleep        // about to sleep: writers must notify (waits for writers that read "busy")
)

// wakeup is one drain's side of the protocol: it says what each claim tells
// writers (op) and, after it, whether the drain goes on, and how soon.
type wakeup struct {
	r  *Relay
	op flagOp // what the next claim tells writers
	// sentOp is what the last claim told them.
	sentOp flagOp
	// nonEmpty counts the claims that found rows; lingered the empty claims
	// in a row while busy; sleepTries the "sleep"s in a row that found
	// writers that saw this relay busy still in their transactions.
	nonEmpty, lingered, sleepTries int
}

// newWakeup starts a drain: one woken by the poll says "sleep" first.
//
// A wake-up usually finds one small batch; saying "busy" and "asleep"
// around it would cost two statements and buy nothing. Writers are told to
// stop notifying only when commits arrive faster than one wake-up per
// commit is worth (busyNow), or a claim after the first of a drain finds
// Config.BusyRows rows (or a full batch).
func (r *Relay) newWakeup(polled bool) *wakeup {
	w := &wakeup{r: r}
	if polled {
		w.op = flagSleep
	}
	return w
}

// claimWindow holds the claims that found rows in the last busyWindow
// (when, and how many rows) and their rows' sum.
type claimWindow struct {
	claims []windowClaim
	sum    int
}

type windowClaim struct {
	at   time.Time
	rows int
}

// busyWindow is how far back the busy rule counts claimed rows: with
// DefaultBusyRows, 8 rows in 20 ms, a rate of 400 TEDs/s and up.
const busyWindow = 20 * time.Millisecond

// add records a claim of n rows at now (busyNow and stillBusy forget what
// is older than busyWindow).
func (c *claimWindow) add(now time.Time, n int) {
	c.claims = append(c.claims, windowClaim{now, n})
	c.sum += n
}

// trim forgets the claims older than busyWindow at now.
func (c *claimWindow) trim(now time.Time) {
	i := 0
	for i < len(c.claims) && now.Sub(c.claims[i].at) > busyWindow {
		c.sum -= c.claims[i].rows
		i++
	}
	if i > 0 {
		c.claims = append(c.claims[:0], c.claims[i:]...)
	}
}

// busyNow: the claims of the last busyWindow, two or more, found
// Config.BusyRows rows between them. That is the commit rate, whatever the
// size of each claim: how many rows a claim finds depends on how long the
// relay's round trip takes, and a rule on that alone sent writers back to
// notifying whenever the relay got faster. At that rate a NOTIFY per commit
// costs writers more than waking the relay saves: notifying commits take a
// lock in turn, each through its WAL flush.
func (r *Relay) busyNow(now time.Time) bool {
	ok := r.stillBusy(now) // trims first
	return ok && len(r.loop.recent.claims) >= 2
}

// stillBusy: the claims of the last busyWindow found Config.BusyRows rows,
// however many claims found them: a busy relay lingers while it holds.
// Under heavy load a round trip can outlast busyWindow, and each claim then
// finds many rows.
func (r *Relay) stillBusy(now time.Time) bool {
	r.loop.recent.trim(now)
	return r.loop.recent.sum >= min(r.cfg.BusyRows, r.cfg.BatchSize)
}

// sent records a claim's round trip: what it told writers, if it succeeded.
func (w *wakeup) sent(res BatchResult, err error) {
	if err != nil {
		// The round trip may have told writers "busy" before it failed
		// (the flag is a sequence: its change is not rolled back), or a
		// later step failed after it did: they may be silent.
		w.r.setState(unsure)
	} else {
		w.r.setState(w.r.loop.state.after(w.op, res.Slept))
	}
	w.sentOp, w.op = w.op, flagNone
}

// empty is told that a claim found nothing; it reports whether the drain is
// over (asleep: every later commit notifies), after lingering or pausing as
// the state says.
func (w *wakeup) empty(ctx context.Context) (done bool) {
	r := w.r
	switch {
	case r.loop.state == asleep:
		return true
	case r.loop.state == saidBusy && (w.lingered < busyLingerClaims || r.stillBusy(time.Now())):
		// Busy, and the claim came back empty: commits arrive in waves
		// (one per WAL flush, longer apart the busier the disk), so wait
		// for the next one before asking writers to notify again: at
		// least busyLingerClaims times, and as long as the rate that
		// made this relay busy holds. Each NOTIFY costs its writer a
		// flush of its own, in turn with the other notifying writers.
		w.lingered++
		retry.Sleep(ctx, lingerStep(w.lingered))
	default:
		if w.sentOp == flagSleep {
			// The sleep found writers that saw us busy still in their
			// transactions: try again a little later, or at once if a
			// notification comes (writers that read "sleep" send one).
			w.sleepTries++
			r.pause(ctx, retry.Backoff(w.sleepTries, busyLingerStep, 100*time.Millisecond))
		}
		w.op = flagSleep
	}
	return false
}

// published is told that a claim found rows and the broker took them.
func (w *wakeup) published(ctx context.Context, res BatchResult) {
	r := w.r
	w.lingered = 0
	now := time.Now()
	r.loop.recent.add(now, res.Claimed)
	// Busy at the rate of busyNow, or when a claim after the first of this
	// drain finds BusyRows rows (or a full batch): slow round trips, each
	// over busyWindow, still meet several commits each. "Busy" is said only
	// with a LISTEN backend to say it as: the other relays take it back if
	// that backend goes.
	w.nonEmpty++
	busy := r.busyNow(now) || w.nonEmpty >= 2 && res.Claimed >= min(r.cfg.BusyRows, r.cfg.BatchSize)
	if r.loop.state != saidBusy && busy && r.listener.pid.Load() != 0 {
		w.op = flagBusy
	}
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

// A relay that told writers it is busy claims again after an empty claim,
// at least busyLingerClaims times in a row and as long as its claims of the
// last busyWindow found BusyRows rows (stillBusy), before it goes back to
// sleep: a busyLingerStep later at first, then less often (lingerStep).
// Each number's measured reason: docs/design.md, "The wake-up protocol's
// numbers".
const (
	busyLingerClaims = 3
	busyLingerStep   = 500 * time.Microsecond
	busyLingerMax    = 2 * time.Millisecond
)

// lingerStep is the pause after the n-th empty claim in a row of a busy
// relay: busyLingerStep for the first three, then twice the last, up to
// busyLingerMax.
func lingerStep(n int) time.Duration {
	if n <= busyLingerClaims {
		return busyLingerStep
	}
	return min(busyLingerStep<<min(n-busyLingerClaims, 8), busyLingerMax)
}

// setState moves the wake-up state, with a debug line per change: the
// chaos suite reads them to hold a writer open while this relay is the only
// one that told writers it is busy (internal/chaos, rolling deploys).
func (r *Relay) setState(s wakeState) {
	if s == r.loop.state {
		return
	}
	r.loop.state = s
	r.log.Debug("wake state", slog.String("state", s.String()))
}

// exitWait bounds how long a stopping relay waits for the writers that saw
// it busy.
const exitWait = 3 * time.Second

// sleepOnExit is a stopping relay's last word. Unless it is asleep, writers
// may be silent because of it, and some that read "busy" may still be in
// their transactions: their rows would wake nobody. So it tells writers to
// notify again, waits for those writers (exitWait at most), and wakes the
// other relays with a NOTIFY sent when that wait is over.
func (r *Relay) sleepOnExit() {
	if r.loop.state == asleep {
		return
	}
	r.wakeWriters(context.Background())
}

// wakeWriters tells writers to notify again, waits for those that read
// "busy" (exitWait at most), and wakes every relay with a NOTIFY sent when
// that wait is over: a stopping relay's last word, and what a relay says on
// behalf of one that died while it had silenced the writers.
func (r *Relay) wakeWriters(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, exitWait)
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
	queue(&b, queries.RelaySleep()).QueryRow(func(row pgx.Row) error { return row.Scan(&slept) })
	queue(&b, r.notify(""))
	if err := r.sendTx(ctx, &b); err != nil {
		return false, err
	}
	return slept, nil
}
