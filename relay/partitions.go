package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/tedbank/outbox/internal/queries"
	"github.com/tedbank/outbox/internal/retry"
	"github.com/tedbank/outbox/partition"
)

// Partition leases (Config.Ownership = OwnPartitions; the table and its
// rules are in sql/migrations/0010_relay_partition_leases.sql), and the
// choice OwnAuto makes between them and row claims (resolveOwnership, at
// the end).
//
// The outbox's partition keys are divided into a fixed number of slots.
// Each relay leases its share of the slots (the number of slots divided by
// the relays alive, rounded up) and renews the leases every
// leaseRenewEvery; a slot whose lease ran out goes to whichever relay needs
// one next. A relay reads its slots' publishable rows in seq order without
// locking or updating them, publishes them, and marks them published with
// the slot's fencing token: a relay that lost a slot to another (it stalled
// past its lease) marks nothing. What it published meanwhile are duplicates,
// which consumers skip; the order per key holds because every publish of a
// key is a run of its unpublished rows in seq order, starting at the oldest.
//
// The leases are owned by the drain goroutine: it renews them between
// batches and while idle, so a slot is never given back with a batch of it
// in flight.
type partitionLeases struct {
	r      *Relay
	leases leases
	// leftoversReclaimed: this relay checked that no row claimer runs and
	// returned a dead one's claims to pending (exclusive.go).
	leftoversReclaimed bool
}

// leases are the slots a partition owner holds.
type leases struct {
	owner string // Config.Name: unique among the live relays
	slots int    // number of slots, read from the table
	// renewed: the first renewal is done (the one that takes back, with new
	// tokens, the slots a killed process of the same name held).
	renewed bool
	held    map[int]lease
	due     time.Time // next renewal
	// relays: the partition owners alive at the last renewal, this one
	// included (relay_lease_share); pid, the LISTEN backend that renewal
	// carried (0: none). The slots are this relay's while that backend
	// lives: once it is gone, the other relays free them at once
	// (relay_bury.sql), without waiting for the leases to run out.
	relays int
	pid    uint32
}

// lease is one slot this relay holds: the fencing token, and until when this
// relay may publish under it (by its own clock, measured from before the
// renewal was sent, so never later than the database's lease_until).
type lease struct {
	token uuid.UUID
	until time.Time
}

// leaseRenewEvery bounds the time between renewals; a third of the lease
// if that is shorter.
const leaseRenewEvery = time.Second

func (p *partitionLeases) renewEvery() time.Duration {
	return min(leaseRenewEvery, p.r.cfg.Lease/3)
}

func (*partitionLeases) lockModes() (own, other int) { return 2, 1 }

// membershipMS: a partition owner's membership is a lease, renewed with
// its slots.
func (p *partitionLeases) membershipMS() int64 { return p.r.cfg.Lease.Milliseconds() }

// listening: the slots must carry the new LISTEN pid: renew now.
func (p *partitionLeases) listening() { p.r.slotsFreed.Store(true) }

// queueWakeOthers: writers are silent while any relay is busy, but this
// relay drains only its own slots: wake the others at every batch while
// busy, and when it says "sleep" (delivered at commit, after the writers
// that saw it busy: their rows may be in other slots).
//
// Not while it is the only relay and holds every slot, its leases all
// current: every row is then in its slots, and there is no one to wake. A
// NOTIFY makes its transaction's commit wait for the cluster-wide lock
// that notifying commits take in turn, each through its WAL flush: behind
// writers that notify (a relay that says "sleep" between short batches, at
// a few hundred TEDs/s), every round trip of the relay's took 100 ms and
// more. A relay that starts meanwhile gets slots only from this one's next
// renewal (they are all held), which counts it, or once this one's LISTEN
// backend is gone (alone checks it is the one its renewal carried), and
// the wake-ups resume.
func (p *partitionLeases) queueWakeOthers(b *pgx.Batch, op flagOp) {
	if (op != flagNone || p.r.loop.state == saidBusy) && !p.alone(time.Now()) {
		queue(b, p.r.notify(p.r.wakePayload()))
	}
}

// alone: at its last renewal this relay was the only partition owner alive
// and it holds every slot, none of them past its lease at now, and the
// LISTEN backend that renewal carried is still its own (a relay whose
// backend went may have lost its slots to a joining relay already).
func (p *partitionLeases) alone(now time.Time) bool {
	l := &p.leases
	if l.relays != 1 || l.slots == 0 || len(l.held) != l.slots || l.pid == 0 || l.pid != p.r.listener.pid.Load() {
		return false
	}
	for _, x := range l.held {
		if !x.until.After(now) {
			return false
		}
	}
	return true
}

// read reads the publishable rows of the slots this relay may publish now,
// in seq order, without locking or updating them.
func (p *partitionLeases) read(_ uuid.UUID, exclude []int64) queries.Statement {
	r := p.r
	return queries.RelayRead(r.batchLimit(), p.leases.slots, p.usableSlots(), append([]int64{}, exclude...),
		r.cfg.RedeliveryWindow().Milliseconds(), r.cfg.BatchBytes)
}

// admit keeps the first row of each key, each fenced by the lease of the
// slot it was read from.
func (p *partitionLeases) admit(_ uuid.UUID, msgs []message) ([]message, fence) {
	msgs = firstOfEachKey(msgs)
	f := slotLeases{slots: make([]int32, len(msgs)), tokens: make([]uuid.UUID, len(msgs))}
	for i, m := range msgs {
		s := partition.Of(m.PartitionKey, p.leases.slots)
		f.slots[i], f.tokens[i] = int32(s), p.leases.held[s].token
	}
	return msgs, f
}

// slotLeases fences the marks of a batch read from leased slots: each row's
// slot and the lease token it was read under, by its place in the batch. A
// relay that lost a slot to another (it stalled past its lease) marks none
// of its rows.
type slotLeases struct {
	slots  []int32
	tokens []uuid.UUID
}

// of returns the slots and tokens of m's rows.
func (f slotLeases) of(m *pendingMark) ([]int32, []uuid.UUID) {
	slots, tokens := make([]int32, len(m.rows)), make([]uuid.UUID, len(m.rows))
	for j, i := range m.rows {
		slots[j], tokens[j] = f.slots[i], f.tokens[i]
	}
	return slots, tokens
}

func (f slotLeases) published(m *pendingMark) queries.Statement {
	slots, tokens := f.of(m)
	return queries.RelayMarkPublishedLeased(m.ids, m.streamIDs, slots, tokens)
}

func (f slotLeases) failed(m *pendingMark, delays []int64, maxAttempts int) queries.Statement {
	slots, tokens := f.of(m)
	return queries.RelayMarkFailedLeased(m.ids, m.streamIDs, delays, slots, tokens, maxAttempts)
}

// release has nothing to give back: the rows were only read, and stay
// pending for this relay's next read.
func (*partitionLeases) release(_ context.Context, _ uuid.UUID, ids []uuid.UUID, _ error) (int, error) {
	return len(ids), nil
}

// renewLeases renews the slots this relay holds, gives back those above its
// share and takes free ones up to it, in one transaction. It reports whether
// it holds more than before (the caller drains them).
func (p *partitionLeases) renewLeases(ctx context.Context) (gained bool, _ error) {
	r, l := p.r, &p.leases
	ctx, cancel := context.WithTimeout(ctx, markTimeout)
	defer cancel()
	sent := time.Now()
	l.due = sent.Add(p.renewEvery())
	r.slotsFreed.Store(false)
	leaseMS := r.cfg.Lease.Milliseconds()
	tx, err := r.pool.Begin(ctx)
	if err != nil {
		return false, fmt.Errorf("renew partition leases: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // after Commit, a no-op
	pid := r.listener.pid.Load()
	held, err := collectLeases(ctx, tx, queries.RelayLeaseRenew(l.owner, leaseMS, !l.renewed, pid))
	if err != nil {
		return false, fmt.Errorf("renew partition leases: %w", err)
	}
	var slots, relays int
	if err := queryRowIn(ctx, tx, queries.RelayLeaseShare()).Scan(&slots, &relays); err != nil {
		return false, fmt.Errorf("partition lease share: %w", err)
	}
	share := (slots + max(relays, 1) - 1) / max(relays, 1)
	var released []int
	if len(held) > share {
		// Give back the highest slots: the free ones are taken lowest first.
		slices.SortFunc(held, func(a, b heldSlot) int { return a.Slot - b.Slot })
		for _, h := range held[share:] {
			released = append(released, h.Slot)
		}
		held = held[:share]
		if _, err := execIn(ctx, tx, queries.RelayLeaseRelease(l.owner, released)); err != nil {
			return false, fmt.Errorf("release partition leases: %w", err)
		}
		if _, err := execIn(ctx, tx, r.notify(r.freedPayload())); err != nil {
			return false, fmt.Errorf("announce released partition leases: %w", err)
		}
	}
	var taken []heldSlot
	if len(held) < share {
		taken, err = collectLeases(ctx, tx, queries.RelayLeaseAcquire(l.owner, leaseMS, share-len(held), pid))
		if err != nil {
			return false, fmt.Errorf("acquire partition leases: %w", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return false, fmt.Errorf("renew partition leases: %w", err)
	}
	before := len(l.held)
	next := make(map[int]lease, len(held)+len(taken))
	until := sent.Add(r.cfg.Lease)
	for _, h := range append(held, taken...) {
		next[h.Slot] = lease{token: h.Token, until: until}
	}
	lost := 0
	for s := range l.held { // slots renewed before and missing now
		if _, ok := next[s]; !ok && !slices.Contains(released, s) {
			lost++
		}
	}
	l.held, l.slots, l.renewed, l.relays, l.pid = next, slots, true, relays, pid
	r.cfg.Metrics.slots(len(next))
	if lost > 0 {
		r.log.Warn("partition leases lost to other relays (this relay did not renew them in time)", slog.Int("slots", lost))
	}
	if len(taken) > 0 || len(released) > 0 || lost > 0 || len(next) != before {
		r.log.Info("partition leases", slog.Int("held", len(next)), slog.Int("taken", len(taken)),
			slog.Int("released", len(released)), slog.Int("slots", slots), slog.Int("relays", relays))
	}
	return len(next) > before, nil
}

// heldSlot is a row of relay_lease_renew or relay_lease_acquire.
type heldSlot struct {
	Slot  int
	Token uuid.UUID
}

func collectLeases(ctx context.Context, tx pgx.Tx, st queries.Statement) ([]heldSlot, error) {
	rows, err := tx.Query(ctx, st.SQL, st.Args...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByName[heldSlot])
}

// renew renews when the renewal is due; a failure is logged (the leases
// run out by themselves, and reads skip a slot whose lease is about to
// end).
func (p *partitionLeases) renew(ctx context.Context) {
	if !p.renewDue() {
		return
	}
	var gained bool
	err := p.r.onFresh(func() (err error) {
		gained, err = p.renewLeases(ctx)
		return err
	})
	switch {
	case err != nil && ctx.Err() == nil:
		p.r.log.Warn("partition lease renewal failed", slog.Any("error", err))
	case gained:
		p.r.kick()
	}
}

// usableSlots are the slots this relay may publish now: a batch started now
// ends (its publish timeout) before their leases do.
func (p *partitionLeases) usableSlots() []int32 {
	limit := time.Now().Add(p.r.cfg.PublishTimeout)
	slots := make([]int32, 0, len(p.leases.held))
	for s, l := range p.leases.held {
		if l.until.After(limit) {
			slots = append(slots, int32(s))
		}
	}
	slices.Sort(slots)
	return slots
}

// firstOfEachKey keeps the first message of each partition key (msgs are in
// seq order): the others wait for the next read, so that a failed publish is
// never overtaken by a later event of its key from the same pipeline.
func firstOfEachKey(msgs []message) []message {
	seen := make(map[[2]string]bool, len(msgs))
	kept := msgs[:0]
	for _, m := range msgs {
		k := [2]string{m.AggregateType, m.PartitionKey}
		if !seen[k] {
			seen[k] = true
			kept = append(kept, m)
		}
	}
	return kept
}

// leave gives back every slot this relay holds and ends its membership,
// and says so: the other relays renew at once and take the slots instead of
// waiting for the leases to run out.
func (p *partitionLeases) leave() {
	r := p.r
	ctx, cancel := context.WithTimeout(context.Background(), markTimeout)
	defer cancel()
	slots := make([]int, 0, len(p.leases.held))
	for s := range p.leases.held {
		slots = append(slots, s)
	}
	err := r.onFresh(func() error { // a batch built anew at each try: pgx keeps per-connection state in it
		var b pgx.Batch
		queue(&b, queries.RelayLeaseRelease(p.leases.owner, slots))
		queue(&b, queries.RelayLeaseLeave(p.leases.owner))
		queue(&b, r.notify(r.freedPayload()))
		return r.pool.SendBatch(ctx, &b).Close()
	})
	if err != nil {
		r.log.Warn("could not give back the partition leases; the other relays take them when they run out",
			slog.Any("error", err), slog.Duration("lease", r.cfg.Lease))
		return
	}
	p.leases.held = nil
	r.cfg.Metrics.slots(0)
}

// renewDue: the partition leases are due for renewal, or another relay gave
// slots back (renew now to take them).
func (p *partitionLeases) renewDue() bool {
	return p.r.slotsFreed.Load() || !time.Now().Before(p.leases.due)
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

// wakePayload is the payload of the notifications a relay that owns
// partitions sends to wake the other relays (its listener ignores its own).
func (r *Relay) wakePayload() string { return "relay:" + r.cfg.Name }

// freedPayload is the payload of the notification a relay sends when it gives
// slots back (more than its share, or all of them on its way out): the
// other relays renew at once and take them, instead of at their next
// renewal.
func (r *Relay) freedPayload() string { return slotsFreedPrefix + r.cfg.Name }

const slotsFreedPrefix = "relay-slots-freed:"

// notify is a NOTIFY on this relay's channel.
func (r *Relay) notify(payload string) queries.Statement {
	return queries.RelayNotify(r.cfg.Channel, payload)
}

// drainOverlapped is drainBatch with partition leases: the last batch's
// mark, the costliest statement (a non-HOT update per row), runs on a
// connection of its own while this batch is read and published; the read
// leaves the last batch's rows out, and may take the next event of their
// keys, which is published after them. (A batch whose publishes failed
// records that before it returns, so the read already sees those rows
// waiting for their retry.)
func (r *Relay) drainOverlapped(ctx context.Context, op flagOp, prev *pendingMark, deferMark bool) (BatchResult, *pendingMark, error) {
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

// prepare returns every 'publishing' row to pending (an attempt counted)
// before a partition owner's first read, once it knows no row claimer runs:
// each such row is a dead claimer's. A relay of the other ownership found
// running stops Run.
func (p *partitionLeases) prepare(ctx context.Context) error {
	r := p.r
	if p.leftoversReclaimed {
		return nil
	}
	err := r.checkOwnership(ctx, func(ctx context.Context, st queries.Statement, dest ...any) error {
		return r.pool.QueryRow(ctx, st.SQL, st.Args...).Scan(dest...)
	})
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
	st := queries.RelayOwnershipAuto(r.cfg.Lease.Milliseconds())
	for failures := 1; ; failures++ {
		var name, reason string
		err := r.pool.QueryRow(ctx, st.SQL, st.Args...).Scan(&name, &reason)
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
