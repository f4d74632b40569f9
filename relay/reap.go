package relay

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tedbank/outbox/internal/queries"
	"github.com/tedbank/outbox/internal/testsignal"
)

// reaper is the relay's maintenance service, one goroutine started by Run:
// every ReapInterval it returns claims whose lease ran out to pending and
// marks dead the events past their redelivery window; told by the LISTEN
// connection's watch (bury), it takes over at once what relays that died or
// stalled left: their memberships, slots and claims, and writers they left
// silent.
type reaper struct {
	r *Relay // the relay it serves: its pool, configuration, log and counters
	// floor is where the reaper's reads start (floor.go).
	floor readFloor
	// due wakes the reaper to take over the work of relays that died;
	// what says what the watch saw, stalled the LISTEN backends of the
	// relays it found stalled.
	due     chan struct{}
	what    atomic.Uint32
	stalled atomic.Pointer[[]int32]
	// waking: a goroutine says "sleep" for a dead relay.
	waking atomic.Bool
	// reaped: a pass returned that many claims (tests only: testsignal).
	reaped testsignal.Signal[int]
}

func newReaper(r *Relay) *reaper { return &reaper{r: r, due: make(chan struct{}, 1)} }

// stepReap returns expired claims to pending and reports how many it returned.
func (r *Relay) stepReap(ctx context.Context) (int, error) {
	return r.reaper.reap(ctx, r.cfg.Lease, nil)
}

// reap returns the claims older than lease to pending. It reads from floor
// (nil: from the start), which only the caller's goroutine may use.
func (p *reaper) reap(ctx context.Context, lease time.Duration, floor *readFloor) (int, error) {
	r := p.r
	total := 0
	for {
		// Bounded: a half-open connection must not hang the reaper (and
		// with it the relay's shutdown) until TCP gives up.
		sctx, cancel := context.WithTimeout(ctx, claimTimeout)
		tag, err := r.execFrom(sctx, floor, queries.RelayReap(lease.Milliseconds(), r.cfg.BatchSize, r.cfg.MaxAttempts, r.listener.pid.Load()))
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

// expire marks dead the events that may have reached the broker longer than
// the redelivery window ago and were never marked published (their
// consumers' dedupe records may be gone), and reports how many.
func (p *reaper) expire(ctx context.Context) (int, error) {
	r := p.r
	total := 0
	for {
		sctx, cancel := context.WithTimeout(ctx, claimTimeout)
		tag, err := r.exec(sctx, queries.RelayExpire(r.cfg.RedeliveryWindow().Milliseconds(), r.cfg.BatchSize))
		cancel()
		if err != nil {
			return total, fmt.Errorf("expire: %w", err)
		}
		n := int(tag.RowsAffected())
		total += n
		if n < r.cfg.BatchSize {
			return total, nil
		}
	}
}

// What the watch (listen.go) saw: a relay died, or writers are silent
// because of a relay that is gone.
const (
	watchDead uint32 = 1 << iota
	watchSilenced
	watchStalled
)

type watchResult struct {
	dead, silenced bool
	stalled        []int32 // the LISTEN backends of relays that stalled
}

func (w watchResult) what() uint32 {
	var v uint32
	if w.dead {
		v |= watchDead
	}
	if w.silenced {
		v |= watchSilenced
	}
	if len(w.stalled) > 0 {
		v |= watchStalled
	}
	return v
}

// bury asks the reaper to take over what dead relays left (what: watchDead,
// watchSilenced); nothing when what is 0.
func (p *reaper) bury(what uint32) {
	if what == 0 {
		return
	}
	p.what.Or(what)
	select {
	case p.due <- struct{}{}:
	default:
	}
}

// takeOver does what the relays that died can no longer do (migration
// 0012): it ends their memberships and frees their partition slots (the
// live relays' shares grow: all of them are told to renew now), returns
// their claims to pending, and, when writers are silent because of one of
// them, tells writers to notify again on their behalf.
func (p *reaper) takeOver(ctx context.Context, what uint32) {
	r := p.r
	if what&watchStalled != 0 && p.terminateStalled(ctx) {
		what |= watchDead
	}
	if what&watchDead != 0 {
		var (
			dead  []string
			slots int
		)
		bctx, cancel := context.WithTimeout(ctx, markTimeout)
		st := queries.RelayBury()
		err := r.onFresh(func() error { return r.pool.QueryRow(bctx, st.SQL, st.Args...).Scan(&dead, &slots) })
		cancel()
		if err != nil {
			if ctx.Err() == nil {
				r.log.Warn("taking over the work of relays that died failed; their leases still bound it", slog.Any("error", err))
			}
			return
		}
		n, err := p.reap(ctx, r.cfg.Lease, &p.floor)
		if err != nil && ctx.Err() == nil {
			r.log.Warn("returning the claims of relays that died failed; the reaper tries again", slog.Any("error", err))
		}
		if err == nil {
			p.reaped.Send(n)
		}
		if len(dead) > 0 || slots > 0 || n > 0 {
			r.log.Warn("relays died: their work is taken over", slog.Any("relays", dead),
				slog.Int("claims_returned", n), slog.Int("slots_freed", slots))
			r.cfg.Metrics.takeover()
		}
		if slots > 0 || len(dead) > 0 {
			// Every live relay renews now: their shares grew.
			r.slotsFreed.Store(true)
			r.kick()
			if _, err := r.exec(ctx, r.notify(slotsFreedPrefix+"dead")); err != nil && ctx.Err() == nil {
				r.log.Warn("waking the other relays to take the freed slots failed; they take them at their next renewal",
					slog.Any("error", err))
			}
		}
		if n > 0 {
			// Wake every relay (this one too): the returned rows are
			// anyone's to claim.
			if _, err := r.exec(ctx, r.notify("")); err != nil {
				r.kick()
			}
		}
	}
	if what&watchSilenced != 0 && p.waking.CompareAndSwap(false, true) {
		// On its own goroutine: the wait for writers (up to exitWait) must
		// not hold up the next takeover.
		r.log.Warn("writers are silent because of a relay that is gone (it said \"busy\" and died): telling them to notify again")
		go func() {
			defer p.waking.Store(false)
			r.wakeWriters(ctx)
		}()
	}
}

func (p *reaper) run(ctx context.Context) {
	r := p.r
	t := time.NewTicker(r.cfg.ReapInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-p.due:
			p.takeOver(ctx, p.what.Swap(0))
			continue
		case <-t.C:
		}
		n, err := p.reap(ctx, r.cfg.Lease, &p.floor)
		switch {
		case err != nil && ctx.Err() == nil:
			r.log.Warn("reaper failed", slog.Any("error", err))
		case n > 0:
			r.log.Warn("returned expired claims to pending", slog.Int("rows", n))
			r.kick()
		}
		if err == nil {
			p.reaped.Send(n)
		}
		switch n, err := p.expire(ctx); {
		case err != nil && ctx.Err() == nil:
			r.log.Warn("marking events past their redelivery window dead failed", slog.Any("error", err))
		case n > 0:
			r.log.Error("events past their redelivery window marked dead: they may have reached the broker, unmarked, longer ago "+
				"than the consumers' dedupe records are sure to last (outbox dead list; retry only if those records still hold)",
				slog.Int("rows", n), slog.Duration("redelivery_window", r.cfg.RedeliveryWindow()))
			r.kick()
		}
	}
}

// terminateStalled terminates the LISTEN backends of the relays the watch
// found stalled (still stalled now), so that their work is taken over as a
// dead relay's, and reports whether it terminated any.
func (p *reaper) terminateStalled(ctx context.Context) bool {
	r := p.r
	pids := p.stalled.Swap(nil)
	if pids == nil {
		return false
	}
	st := queries.RelayStalled(*pids, stallAfter.Milliseconds())
	type stalled struct {
		Relay string
		PID   int32
	}
	var found []stalled
	sctx, cancel := context.WithTimeout(ctx, claimTimeout)
	defer cancel()
	err := r.onFresh(func() error {
		rows, err := r.pool.Query(sctx, st.SQL, st.Args...)
		if err != nil {
			return err
		}
		found, err = pgx.CollectRows(rows, pgx.RowToStructByPos[stalled])
		return err
	})
	if err != nil {
		if ctx.Err() == nil {
			r.log.Warn("terminating the LISTEN connection of a stalled relay failed; its leases still bound its work",
				slog.Any("error", err))
		}
		return false
	}
	for _, s := range found {
		r.log.Warn("relay stalled: its LISTEN connection was quiet too long, its connections open; terminated, "+
			"so that its work is taken over (it reconnects when it wakes up)",
			slog.String("stalled_relay", s.Relay), slog.Int("pid", int(s.PID)), slog.Duration("quiet_for_more_than", stallAfter))
	}
	return len(found) > 0
}
