package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/tedbank/outbox/internal/queries"
	"github.com/tedbank/outbox/internal/retry"
	"github.com/tedbank/outbox/relay/internal/leases"
)

// Partition leases (Config.Ownership = OwnPartitions): the relay's side of
// them. The lease protocol itself (take, renew and give back the slots,
// read their rows, fence the marks) is package relay/internal/leases; here
// is when the relay renews, the check that no row claimer runs before the
// first read, the wake-ups of the relays that own the other slots, the
// overlap of a batch's mark with the next read, and the choice OwnAuto
// makes between partition leases and row claims (resolveOwnership, at the
// end).
//
// The leases are owned by the drain goroutine: it renews them between
// batches and while idle, so a slot is never given back with a batch of it
// in flight.
type partitionLeases struct {
	r      *Relay
	leases *leases.Leases
	// leftoversReclaimed: this relay checked that no row claimer runs and
	// returned a dead one's claims to pending (exclusive.go).
	leftoversReclaimed bool
	// inFlight is the seqs of the batch whose mark runs beside the read
	// (drainBeside): the read leaves them out.
	inFlight []int64
}

func newPartitionLeases(r *Relay) *partitionLeases {
	return &partitionLeases{r: r, leases: leases.New(r.pool.Pool, r.log, leaseHost{r}, leases.Settings{
		Owner: r.cfg.Name, Lease: r.cfg.Lease, PublishTimeout: r.cfg.PublishTimeout, Timeout: markTimeout,
	})}
}

// leaseHost is what the leases need of their relay (leases.Host).
type leaseHost struct{ r *Relay }

func (h leaseHost) OnFresh(fn func() error) error { return h.r.onFresh(fn) }
func (h leaseHost) ListenPID() uint32             { return h.r.listener.pid.Load() }
func (h leaseHost) Freed() queries.Statement      { return h.r.notify(h.r.freedPayload()) }
func (h leaseHost) Held(n int)                    { h.r.cfg.Metrics.slots(n) }

func (p *partitionLeases) renewEvery() time.Duration { return p.leases.RenewEvery() }

func (*partitionLeases) lockModes() (own, other int) { return 2, 1 }

// membershipMS: a partition owner's membership is a lease, renewed with
// its slots.
func (p *partitionLeases) membershipMS() int64 { return p.r.cfg.Lease.Milliseconds() }

// queueWakeOthers: writers are silent while any relay is busy, but this
// relay drains only its own slots: wake the others at every batch while
// busy, and when it says "sleep" (delivered at commit, after the writers
// that saw it busy: their rows may be in other slots).
//
// Not while it is the only relay and holds every slot, its leases all
// current (leases.Alone): every row is then in its slots, and there is no
// one to wake. A NOTIFY makes its transaction's commit wait for the
// cluster-wide lock that notifying commits take in turn, each through its
// WAL flush: behind writers that notify (a relay that says "sleep" between
// short batches, at a few hundred TEDs/s), every round trip of the relay's
// took 100 ms and more. A relay that starts meanwhile gets slots only from
// this one's next renewal (they are all held), which counts it, or once
// this one's LISTEN backend is gone (Alone checks it is the one its
// renewal carried), and the wake-ups resume.
func (p *partitionLeases) queueWakeOthers(b *pgx.Batch, op flagOp) {
	if (op != flagNone || p.r.loop.state == saidBusy) && !p.leases.Alone(time.Now()) {
		queue(b, p.r.notify(p.r.wakePayload()))
	}
}

// read reads the publishable rows of the slots this relay may publish now,
// in seq order, without locking or updating them, leaving out the batch
// whose mark is in flight.
func (p *partitionLeases) read(uuid.UUID) queries.Statement {
	r := p.r
	return p.leases.Read(r.batchLimit(), p.inFlight, r.cfg.RedeliveryWindow(), r.cfg.BatchBytes)
}

// admit keeps the first row of each key, each fenced by the lease of the
// slot it was read from.
func (p *partitionLeases) admit(_ uuid.UUID, msgs []message) ([]message, fence) {
	msgs, f := p.leases.Admit(msgs)
	return msgs, slotLeases{f}
}

// slotLeases fences the marks of a batch read from leased slots
// (leases.Fence: each row's slot and the token it was read under).
type slotLeases struct{ leases.Fence }

func (f slotLeases) published(m *pendingMark) queries.Statement {
	return f.Published(m.ids, m.streamIDs, m.rows)
}

func (f slotLeases) failed(m *pendingMark, delays []int64, maxAttempts int) queries.Statement {
	return f.Failed(m.ids, m.streamIDs, m.rows, delays, maxAttempts)
}

// release has nothing to give back: the rows were only read, and stay
// pending for this relay's next read.
func (*partitionLeases) release(_ context.Context, _ uuid.UUID, ids []uuid.UUID, _ error) (int, error) {
	return len(ids), nil
}

// renew renews when the renewal is due; a failure is logged (the leases
// run out by themselves, and reads skip a slot whose lease is about to
// end).
func (p *partitionLeases) renew(ctx context.Context) {
	if !p.renewDue() {
		return
	}
	var gained bool
	p.r.slotsFreed.Store(false)
	err := p.r.onFresh(func() (err error) {
		gained, err = p.leases.Renew(ctx)
		return err
	})
	switch {
	case err != nil && ctx.Err() == nil:
		p.r.log.Warn("partition lease renewal failed", slog.Any("error", err))
	case gained:
		p.r.kick()
	}
}

// leave gives back every slot this relay holds and ends its membership.
func (p *partitionLeases) leave() { p.leases.Leave() }

// renewDue: the partition leases are due for renewal, or another relay gave
// slots back (renew now to take them).
func (p *partitionLeases) renewDue() bool {
	return p.r.slotsFreed.Load() || p.leases.Due(time.Now())
}

// beforeBatch: before the first read, the check that no row claimer runs
// (prepare, exclusive.go); before each batch, a renewal when due, the last
// batch's mark first (flush).
func (p *partitionLeases) beforeBatch(ctx context.Context, flush func() error) error {
	if err := p.prepare(ctx); err != nil {
		return err
	}
	if !p.renewDue() {
		return nil
	}
	if flush != nil {
		if err := flush(); err != nil {
			return err
		}
	}
	p.renew(ctx)
	return nil
}

// drainBeside: the last batch's mark, the costliest statement (a non-HOT
// update per row), runs on a connection of its own while this batch is read
// and published; the read leaves the last batch's rows out, and may take
// the next event of their keys, which is published after them. (A batch
// whose publishes failed records that before it returns, so the read
// already sees those rows waiting for their retry.)
func (p *partitionLeases) drainBeside(ctx context.Context, prev *pendingMark, drain func() (BatchResult, *pendingMark, error)) (BatchResult, *pendingMark, error) {
	join := p.r.markAsync(ctx, prev)
	p.inFlight = prev.seqs
	res, next, err := drain()
	p.inFlight = nil
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

// prepare returns every 'publishing' row to pending (an attempt counted)
// before a partition owner's first read, once it knows no row claimer runs:
// each such row is a dead claimer's. A relay of the other ownership found
// running stops Run.
func (p *partitionLeases) prepare(ctx context.Context) error {
	r := p.r
	if p.leftoversReclaimed {
		return nil
	}
	err := r.checkOwnership(ctx, r.queryRow)
	if errors.Is(err, ErrMixedOwnership) && r.stop != nil {
		r.log.Error("relay stopping", slog.Any("error", err))
		r.stop(err)
	}
	if err != nil {
		return err
	}
	n, err := r.reaper.reap(ctx, 0, nil)
	if err != nil {
		return fmt.Errorf("return a dead row claimer's claims to pending: %w", err)
	}
	if n > 0 {
		r.log.Warn("returned the claims of relays that claimed rows (before a switch to partition leases) to pending",
			slog.Int("rows", n))
	}
	p.leftoversReclaimed = true
	return nil
}

// resolveOwnership chooses, for a relay of OwnAuto, the ownership of the
// relays running on the database, and with none running, row claims while a
// row claimer may still be running unseen (its LISTEN connection down: a
// PostgreSQL restart), partition leases otherwise
// (relay_ownership_auto.sql). It runs before the relay does anything else,
// and waits for a database that does not answer yet: it fails only when ctx
// ends. An auto relay that chooses at the very moment a relay of the other
// ownership starts is caught as before: the check after the LISTEN
// connection stops one of them with ErrMixedOwnership, and the next Run
// chooses again (a Run right after one that claimed rows may still see its
// own LISTEN backend's lock, and be refused once more).
func (r *Relay) resolveOwnership(ctx context.Context) error {
	if r.own.ownership != nil {
		return nil
	}
	for failures := 1; ; failures++ {
		var name, reason string
		err := r.pool.roundTrip(func() (err error) {
			name, reason, err = leases.Choose(ctx, r.pool.Pool, r.cfg.Lease)
			return err
		})
		if err == nil {
			r.chooseOwnership(name)
			r.log.Info("ownership chosen (auto)", slog.String("ownership", name), slog.String("by", reason))
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		d := retry.Backoff(failures, 100*time.Millisecond, min(listenBackoffMax, max(r.cfg.PollInterval, time.Second)))
		r.log.Warn("cannot choose the ownership (auto) until the database answers; retrying",
			slog.Any("error", err), slog.Int("attempt", failures), slog.Duration("retry_in", d))
		retry.Sleep(ctx, d)
	}
}
