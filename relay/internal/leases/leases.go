// Package leases is the lease protocol of a relay that owns partition keys
// (relay.Config.Ownership "partitions"; the table and its rules are in
// sql/migrations/0010_relay_partition_leases.sql), and the choice an "auto"
// relay makes between it and row claims (Choose).
//
// The outbox's partition keys are divided into a fixed number of slots.
// Each relay leases its share of the slots (the number of slots divided by
// the relays alive, rounded up) and renews the leases every RenewEvery; a
// slot whose lease ran out goes to whichever relay needs one next. A relay
// reads its slots' publishable rows in seq order without locking or
// updating them (Read), publishes them, and marks them published with the
// slot's fencing token (Fence): a relay that lost a slot to another (it
// stalled past its lease) marks nothing. What it published meanwhile are
// duplicates, which consumers skip; the order per key holds because every
// publish of a key is a run of its unpublished rows in seq order, starting
// at the oldest (Admit keeps the first of each key).
//
// Package relay drives it (relay/partitions.go): when to renew, the check
// that no row claimer runs, the wake-ups of the other relays and the
// overlap of a batch's mark with the next read are the relay's.
package leases

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/internal/queries"
	"github.com/tedbank/outbox/partition"
	"github.com/tedbank/outbox/relay/broker"
)

// Host is what the leases need of their relay.
type Host interface {
	// OnFresh runs fn, and again on a fresh connection when the server
	// closed the pooled one.
	OnFresh(fn func() error) error
	// ListenPID is the relay's LISTEN backend (0: none now).
	ListenPID() uint32
	// Freed is the NOTIFY that tells the other relays slots were given back.
	Freed() queries.Statement
	// Held reports how many slots the relay holds now.
	Held(n int)
}

// Settings are the relay's settings the leases follow.
type Settings struct {
	Owner          string        // the relay's name: unique among the live relays
	Lease          time.Duration // how long a slot's lease lasts without renewal
	PublishTimeout time.Duration // how long a batch may take: no read of a slot whose lease ends sooner
	Timeout        time.Duration // of each round trip
}

// Leases are the slots a partition owner holds. Not safe for concurrent
// use: the relay's drainer owns them.
type Leases struct {
	pool *pgxpool.Pool
	log  *slog.Logger
	host Host
	set  Settings

	slots int // number of slots, read from the table
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

// New returns the leases of relay set.Owner, none held yet.
func New(pool *pgxpool.Pool, log *slog.Logger, host Host, set Settings) *Leases {
	return &Leases{pool: pool, log: log, host: host, set: set}
}

// renewEvery bounds the time between renewals; a third of the lease if that
// is shorter.
const renewEvery = time.Second

// RenewEvery is how often the leases are renewed.
func (l *Leases) RenewEvery() time.Duration { return min(renewEvery, l.set.Lease/3) }

// Due reports whether the renewal is due at now.
func (l *Leases) Due(now time.Time) bool { return !now.Before(l.due) }

// Alone: at its last renewal this relay was the only partition owner alive
// and it holds every slot, none of them past its lease at now, and the
// LISTEN backend that renewal carried is still its own (a relay whose
// backend went may have lost its slots to a joining relay already).
func (l *Leases) Alone(now time.Time) bool {
	if l.relays != 1 || l.slots == 0 || len(l.held) != l.slots || l.pid == 0 || l.pid != l.host.ListenPID() {
		return false
	}
	for _, x := range l.held {
		if !x.until.After(now) {
			return false
		}
	}
	return true
}

// Read is the statement that reads up to batch publishable rows of the
// slots this relay may publish now, in seq order, without locking or
// updating them, leaving out the rows of exclude (a batch whose mark is in
// flight).
func (l *Leases) Read(batch int, exclude []int64, window time.Duration, maxBytes int64) queries.Statement {
	return queries.RelayRead(batch, l.slots, l.usable(), append([]int64{}, exclude...), window.Milliseconds(), maxBytes)
}

// usable are the slots this relay may publish now: a batch started now
// ends (its publish timeout) before their leases do.
func (l *Leases) usable() []int32 {
	limit := time.Now().Add(l.set.PublishTimeout)
	slots := make([]int32, 0, len(l.held))
	for s, x := range l.held {
		if x.until.After(limit) {
			slots = append(slots, int32(s))
		}
	}
	slices.Sort(slots)
	return slots
}

// Admit keeps the first row of each key of a read (msgs, in seq order),
// each fenced by the lease of the slot it was read from: the others wait
// for the next read, so that a failed publish is never overtaken by a
// later event of its key from the same pipeline.
func (l *Leases) Admit(msgs []broker.Message) ([]broker.Message, Fence) {
	msgs = firstOfEachKey(msgs)
	f := Fence{slots: make([]int32, len(msgs)), tokens: make([]uuid.UUID, len(msgs))}
	for i, m := range msgs {
		s := partition.Of(m.PartitionKey, l.slots)
		f.slots[i], f.tokens[i] = int32(s), l.held[s].token
	}
	return msgs, f
}

func firstOfEachKey(msgs []broker.Message) []broker.Message {
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

// Fence fences the marks of a batch read from leased slots: each row's slot
// and the lease token it was read under, by its place in the batch. A relay
// that lost a slot to another (it stalled past its lease) marks none of its
// rows.
type Fence struct {
	slots  []int32
	tokens []uuid.UUID
}

// of returns the slots and tokens of the rows at places rows of the batch.
func (f Fence) of(rows []int) ([]int32, []uuid.UUID) {
	slots, tokens := make([]int32, len(rows)), make([]uuid.UUID, len(rows))
	for j, i := range rows {
		slots[j], tokens[j] = f.slots[i], f.tokens[i]
	}
	return slots, tokens
}

// Published marks the rows ids (at places rows of the batch) published as
// the stream entries streamIDs, where their slots still carry their tokens.
func (f Fence) Published(ids []uuid.UUID, streamIDs []string, rows []int) queries.Statement {
	slots, tokens := f.of(rows)
	return queries.RelayMarkPublishedLeased(ids, streamIDs, slots, tokens)
}

// Failed records failed publishes of the rows ids (at places rows), with
// their backoff delays, where their slots still carry their tokens.
func (f Fence) Failed(ids []uuid.UUID, streamIDs []string, rows []int, delays []int64, maxAttempts int) queries.Statement {
	slots, tokens := f.of(rows)
	return queries.RelayMarkFailedLeased(ids, streamIDs, delays, slots, tokens, maxAttempts)
}

// Renew renews the slots this relay holds, gives back those above its
// share and takes free ones up to it, in one transaction. It reports
// whether the relay may now read a slot it could not read before: one it
// took, or one it kept whose lease had run too short to read (renewals
// failed meanwhile). The relay drains then: the rows of such a slot were
// left behind by the reads in between, and the notifications that
// announced them are spent.
func (l *Leases) Renew(ctx context.Context) (gained bool, _ error) {
	ctx, cancel := context.WithTimeout(ctx, l.set.Timeout)
	defer cancel()
	sent := time.Now()
	readable := l.usable()
	l.due = sent.Add(l.RenewEvery())
	leaseMS := l.set.Lease.Milliseconds()
	tx, err := l.pool.Begin(ctx)
	if err != nil {
		return false, fmt.Errorf("renew partition leases: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // after Commit, a no-op
	pid := l.host.ListenPID()
	held, err := collect(ctx, tx, queries.RelayLeaseRenew(l.set.Owner, leaseMS, !l.renewed, pid))
	if err != nil {
		return false, fmt.Errorf("renew partition leases: %w", err)
	}
	var slots, relays int
	share := queries.RelayLeaseShare()
	if err := tx.QueryRow(ctx, share.SQL, share.Args...).Scan(&slots, &relays); err != nil {
		return false, fmt.Errorf("partition lease share: %w", err)
	}
	mine := (slots + max(relays, 1) - 1) / max(relays, 1)
	var released []int
	if len(held) > mine {
		// Give back the highest slots: the free ones are taken lowest first.
		slices.SortFunc(held, func(a, b heldSlot) int { return a.Slot - b.Slot })
		for _, h := range held[mine:] {
			released = append(released, h.Slot)
		}
		held = held[:mine]
		if err := exec(ctx, tx, queries.RelayLeaseRelease(l.set.Owner, released)); err != nil {
			return false, fmt.Errorf("release partition leases: %w", err)
		}
		if err := exec(ctx, tx, l.host.Freed()); err != nil {
			return false, fmt.Errorf("announce released partition leases: %w", err)
		}
	}
	var taken []heldSlot
	if len(held) < mine {
		taken, err = collect(ctx, tx, queries.RelayLeaseAcquire(l.set.Owner, leaseMS, mine-len(held), pid))
		if err != nil {
			return false, fmt.Errorf("acquire partition leases: %w", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return false, fmt.Errorf("renew partition leases: %w", err)
	}
	before := len(l.held)
	next := make(map[int]lease, len(held)+len(taken))
	until := sent.Add(l.set.Lease)
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
	l.host.Held(len(next))
	if lost > 0 {
		l.log.Warn("partition leases lost to other relays (this relay did not renew them in time)", slog.Int("slots", lost))
	}
	if len(taken) > 0 || len(released) > 0 || lost > 0 || len(next) != before {
		l.log.Info("partition leases", slog.Int("held", len(next)), slog.Int("taken", len(taken)),
			slog.Int("released", len(released)), slog.Int("slots", slots), slog.Int("relays", relays))
	}
	for _, slot := range l.usable() {
		if !slices.Contains(readable, slot) {
			return true, nil
		}
	}
	return false, nil
}

// heldSlot is a row of relay_lease_renew or relay_lease_acquire.
type heldSlot struct {
	Slot  int
	Token uuid.UUID
}

func collect(ctx context.Context, tx pgx.Tx, st queries.Statement) ([]heldSlot, error) {
	rows, err := tx.Query(ctx, st.SQL, st.Args...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByName[heldSlot])
}

func exec(ctx context.Context, tx pgx.Tx, st queries.Statement) error {
	_, err := tx.Exec(ctx, st.SQL, st.Args...)
	return err
}

// Leave gives back every slot this relay holds and ends its membership,
// and says so: the other relays renew at once and take the slots instead of
// waiting for the leases to run out.
func (l *Leases) Leave() {
	ctx, cancel := context.WithTimeout(context.Background(), l.set.Timeout)
	defer cancel()
	slots := make([]int, 0, len(l.held))
	for s := range l.held {
		slots = append(slots, s)
	}
	err := l.host.OnFresh(func() error { // a batch built anew at each try: pgx keeps per-connection state in it
		var b pgx.Batch
		for _, st := range []queries.Statement{
			queries.RelayLeaseRelease(l.set.Owner, slots),
			queries.RelayLeaseLeave(l.set.Owner),
			l.host.Freed(),
		} {
			b.Queue(st.SQL, st.Args...)
		}
		return l.pool.SendBatch(ctx, &b).Close()
	})
	if err != nil {
		l.log.Warn("could not give back the partition leases; the other relays take them when they run out",
			slog.Any("error", err), slog.Duration("lease", l.set.Lease))
		return
	}
	l.held = nil
	l.host.Held(0)
}

// Choose is the ownership an "auto" relay runs ("rows" or "partitions") and
// why (relay_ownership_auto.sql): that of the relays running on the
// database, and with none running, row claims while a row claimer may
// still be running unseen (its LISTEN connection down: a PostgreSQL
// restart), partition leases otherwise. lease is the relays' lease: a
// claim younger than it says a row claimer ran.
func Choose(ctx context.Context, pool *pgxpool.Pool, lease time.Duration) (name, reason string, _ error) {
	st := queries.RelayOwnershipAuto(lease.Milliseconds())
	err := pool.QueryRow(ctx, st.SQL, st.Args...).Scan(&name, &reason)
	return name, reason, err
}
