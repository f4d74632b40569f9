package relay

import (
	"context"
	"log/slog"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/tedbank/outbox/internal/queries"
)

// ownership is how a relay comes to own the rows it publishes: it claims
// them (rowClaims, below: Config.Ownership OwnRows, the card's path) or
// leases slots of partition keys and reads their rows (partitionLeases,
// partitions.go: OwnPartitions). It is chosen once: in New when the Config
// names one, else (OwnAuto) when Run starts, by the relays already running
// (resolveOwnership, partitions.go). Each claimed batch carries what fences
// its marks (fence); partition leases have duties of their own beside the
// drain (leaseKeeper), which row claims do not.
type ownership interface {
	// lockModes are the advisory lock this ownership holds on the LISTEN
	// connection and the other ownership's (exclusive.go).
	lockModes() (own, other int)
	// membershipMS is how long a membership lasts without renewal (0: for
	// as long as the LISTEN backend lives).
	membershipMS() int64
	// read is the claim's statement: up to a batch of rows to publish.
	read(token uuid.UUID) queries.Statement
	// admit keeps the rows of a read that go into one publish, and returns
	// what fences their marks.
	admit(token uuid.UUID, msgs []message) ([]message, fence)
	// release gives back rows no attempt was spent on (the broker was
	// unavailable) and returns how many.
	release(ctx context.Context, token uuid.UUID, ids []uuid.UUID, cause error) (int, error)
	// leave ends what this relay owns, on its way out.
	leave()
}

// fence is what the marks of a claimed batch are fenced by: the claim token
// (row claims) or the slot lease each row was read under (partition leases).
// A mark updates only the rows the fence still holds: a row another relay
// took over after this one lost it is left to that relay.
type fence interface {
	// published and failed are the statements that record the outcome of
	// m's rows (m.rows are their places in the batch).
	published(m *pendingMark) queries.Statement
	failed(m *pendingMark, delays []int64, maxAttempts int) queries.Statement
}

// leaseKeeper is what partition leases do beside the drain, and row claims
// do not: take, renew and give back the slots, wake the relays that own the
// other slots, and send a batch's mark beside the next batch.
type leaseKeeper interface {
	// beforeBatch runs before each batch: once, the check that no row
	// claimer runs; when due, a renewal of the leases, after flush (the
	// last batch's mark: a slot given back with its mark unsent would
	// leave its rows to be published twice).
	beforeBatch(ctx context.Context, flush func() error) error
	// renew takes or renews this relay's slots when due (a failure is
	// logged); renewEvery is how often it runs while the relay is idle.
	renew(ctx context.Context)
	renewEvery() time.Duration
	// queueWakeOthers queues, in a claim's round trip, what wakes the other
	// relays while this one tells writers op (or has told them "busy").
	queueWakeOthers(b *pgx.Batch, op flagOp)
	// drainBeside runs drain (one batch, its read leaving prev's rows out)
	// while prev's mark is sent on a connection of its own, and counts
	// that mark in the result.
	drainBeside(ctx context.Context, prev *pendingMark, drain func() (BatchResult, *pendingMark, error)) (BatchResult, *pendingMark, error)
}

// owner is the relay's ownership and, for partition leases, their keeper
// (nil for row claims).
type owner struct {
	ownership
	leases leaseKeeper
}

// newOwnership is the ownership named (OwnRows or OwnPartitions).
func newOwnership(r *Relay, name string) owner {
	if name == OwnPartitions {
		p := newPartitionLeases(r)
		return owner{ownership: p, leases: p}
	}
	return owner{ownership: rowClaims{r}}
}

// chooseOwnership sets the relay's ownership: the one its Config names, or
// for OwnAuto the one resolveOwnership finds (until then, none).
func (r *Relay) chooseOwnership(name string) {
	if name == OwnAuto {
		r.own = owner{}
		r.ownName.Store(nil)
		return
	}
	r.own = newOwnership(r, name)
	r.ownName.Store(&name)
}

// forgetOwnership: a relay of OwnAuto stopped by ErrMixedOwnership chooses
// again at its next Run (it follows the relay it met); one that names its
// ownership keeps it.
func (r *Relay) forgetOwnership() {
	if r.cfg.Ownership == OwnAuto {
		r.chooseOwnership(OwnAuto)
	}
}

// Ownership is the ownership the relay runs with, OwnRows or
// OwnPartitions; "" for a relay of OwnAuto before Run chose it.
func (r *Relay) Ownership() string {
	if p := r.ownName.Load(); p != nil {
		return *p
	}
	return ""
}

// rowClaims: each relay claims rows with FOR UPDATE SKIP LOCKED, marking
// them publishing under a fresh claim token with a lease (claimed_at); the
// marks are fenced by the token, the reaper returns expired claims.
type rowClaims struct{ r *Relay }

func (rowClaims) lockModes() (own, other int) { return 1, 2 }
func (rowClaims) membershipMS() int64         { return 0 }

func (o rowClaims) read(token uuid.UUID) queries.Statement {
	r := o.r
	return queries.RelayClaim(r.batchLimit(), token, r.cfg.Name, r.cfg.RedeliveryWindow().Milliseconds(), r.listener.pid.Load(), r.cfg.BatchBytes)
}

// admit: every claimed row goes into the publish, fenced by the claim token.
func (rowClaims) admit(token uuid.UUID, msgs []message) ([]message, fence) {
	return msgs, claimToken(token)
}

// claimToken fences the marks of a batch of claimed rows: a row the reaper
// returned to pending and another relay claimed has another token.
type claimToken uuid.UUID

func (t claimToken) published(m *pendingMark) queries.Statement {
	return queries.RelayMarkPublished(m.ids, m.streamIDs, uuid.UUID(t))
}

func (t claimToken) failed(m *pendingMark, delays []int64, maxAttempts int) queries.Statement {
	return queries.RelayMarkFailed(m.ids, m.streamIDs, delays, uuid.UUID(t), maxAttempts)
}

// release returns the rows to pending, claimable again after releaseDelay.
func (o rowClaims) release(ctx context.Context, token uuid.UUID, ids []uuid.UUID, cause error) (int, error) {
	return o.r.release(ctx, token, ids, releaseDelay, cause)
}

// leave ends the relay's membership (relay_register.sql) here, rather than
// with the other relays finding it dead.
func (o rowClaims) leave() {
	ctx, cancel := context.WithTimeout(context.Background(), markTimeout)
	defer cancel()
	if _, err := o.r.exec(ctx, queries.RelayLeaseLeave(o.r.cfg.Name)); err != nil {
		o.r.log.Debug("could not end the relay's membership; the other relays end it when they find it gone", slog.Any("error", err))
	}
}
