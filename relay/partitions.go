package relay

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/tedbank/outbox/internal/queries"
	"github.com/tedbank/outbox/partition"
)

// Partition leases (Config.Ownership = OwnPartitions; the table and its
// rules are in sql/migrations/0010_relay_partition_leases.sql).
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
type leases struct {
	owner string // Config.Name: unique among the live relays
	slots int    // number of slots, read from the table
	// renewed: the first renewal is done (the one that takes back, with new
	// tokens, the slots a killed process of the same name held).
	renewed bool
	held    map[int]lease
	due     time.Time // next renewal
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

func (r *Relay) leaseRenewInterval() time.Duration {
	return min(leaseRenewEvery, r.cfg.Lease/3)
}

// renewLeases renews the slots this relay holds, gives back those above its
// share and takes free ones up to it, in one transaction. It reports whether
// it holds more than before (the caller drains them).
func (r *Relay) renewLeases(ctx context.Context) (gained bool, _ error) {
	l := &r.leases
	ctx, cancel := context.WithTimeout(ctx, markTimeout)
	defer cancel()
	sent := time.Now()
	l.due = sent.Add(r.leaseRenewInterval())
	r.slotsFreed.Store(false)
	leaseMS := r.cfg.Lease.Milliseconds()
	tx, err := r.pool.Begin(ctx)
	if err != nil {
		return false, fmt.Errorf("renew partition leases: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // after Commit, a no-op
	held, err := collectLeases(ctx, tx, queries.RelayLeaseRenew(l.owner, leaseMS, !l.renewed, r.listenPID.Load()))
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
		taken, err = collectLeases(ctx, tx, queries.RelayLeaseAcquire(l.owner, leaseMS, share-len(held), r.listenPID.Load()))
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
	l.held, l.slots, l.renewed = next, slots, true
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

// renewLeasesIfDue renews when the renewal is due; a failure is logged (the
// leases run out by themselves, and reads skip a slot whose lease is about
// to end).
func (r *Relay) renewLeasesIfDue(ctx context.Context) {
	if !r.leaseRenewalDue() {
		return
	}
	gained, err := r.renewLeases(ctx)
	switch {
	case err != nil && ctx.Err() == nil:
		r.log.Warn("partition lease renewal failed", slog.Any("error", err))
	case gained:
		r.kick()
	}
}

// usableSlots are the slots this relay may publish now: a batch started now
// ends (its publish timeout) before their leases do.
func (r *Relay) usableSlots() []int32 {
	limit := time.Now().Add(r.cfg.PublishTimeout)
	slots := make([]int32, 0, len(r.leases.held))
	for s, l := range r.leases.held {
		if l.until.After(limit) {
			slots = append(slots, int32(s))
		}
	}
	slices.Sort(slots)
	return slots
}

// leaseOf returns the slot m was read from and the token it was read under.
func (r *Relay) leaseOf(m message) rowLease {
	s := partition.Of(m.PartitionKey, r.leases.slots)
	return rowLease{slot: int32(s), token: r.leases.held[s].token}
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

// leaveLeases gives back every slot this relay holds and ends its
// membership, and says so: the other relays renew at once and take the slots
// instead of waiting for the leases to run out.
func (r *Relay) leaveLeases() {
	ctx, cancel := context.WithTimeout(context.Background(), markTimeout)
	defer cancel()
	if !r.ownsPartitions() {
		// A row claimer's membership (relay_register.sql) ends here, not
		// with the other relays finding it dead.
		if _, err := r.exec(ctx, queries.RelayLeaseLeave(r.leases.owner)); err != nil {
			r.log.Debug("could not end the relay's membership; the other relays end it when they find it gone", slog.Any("error", err))
		}
		return
	}
	slots := make([]int, 0, len(r.leases.held))
	for s := range r.leases.held {
		slots = append(slots, s)
	}
	var b pgx.Batch
	queue(&b, queries.RelayLeaseRelease(r.leases.owner, slots))
	queue(&b, queries.RelayLeaseLeave(r.leases.owner))
	queue(&b, r.notify(r.freedPayload()))
	if err := r.pool.SendBatch(ctx, &b).Close(); err != nil {
		r.log.Warn("could not give back the partition leases; the other relays take them when they run out",
			slog.Any("error", err), slog.Duration("lease", r.cfg.Lease))
		return
	}
	r.leases.held = nil
	r.cfg.Metrics.slots(0)
}

// rowLease is the slot a row was read from and the lease token it was read
// under: its mark is fenced by them.
type rowLease struct {
	slot  int32
	token uuid.UUID
}

// leaseRenewalDue: the partition leases are due for renewal, or another
// relay gave slots back (renew now to take them).
func (r *Relay) leaseRenewalDue() bool {
	return r.ownsPartitions() && (r.slotsFreed.Load() || !time.Now().Before(r.leases.due))
}

// membershipMS is how long a membership lasts without renewal: a partition
// owner's, a lease (renewed with its leases); a row claimer's, until its
// LISTEN backend is gone (0).
func (r *Relay) membershipMS() int64 {
	if r.ownsPartitions() {
		return r.cfg.Lease.Milliseconds()
	}
	return 0
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
