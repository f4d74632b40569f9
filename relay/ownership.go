package relay

import (
	"context"
	"log/slog"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/tedbank/outbox/internal/queries"
	"github.com/tedbank/outbox/internal/retry"
)

// ownership is how a relay comes to own the rows it publishes: it claims
// them (rowClaims, below: Config.Ownership OwnRows) or leases slots of
// partition keys and reads their rows (partitionLeases, partitions.go:
// OwnPartitions). It is chosen once: in New when the Config names
// one, else (OwnAuto) when Run starts, by the relays already running
// (resolveOwnership). The drain asks it at each step where the two differ,
// and is otherwise the card's path: claim, publish, mark.
type ownership interface {
	// lockModes are the advisory lock this ownership holds on the LISTEN
	// connection and the other ownership's (exclusive.go).
	lockModes() (own, other int)
	// membershipMS is how long a membership lasts without renewal (0: for
	// as long as the LISTEN backend lives).
	membershipMS() int64
	// prepare runs before each drain and single step.
	prepare(ctx context.Context) error
	// renewDue reports whether renew must run before the next batch; renew
	// takes or renews what the relay owns (a failure is logged), and
	// renewEvery is how often it runs while idle (0: never).
	renewDue() bool
	renew(ctx context.Context)
	renewEvery() time.Duration
	// queueWakeOthers queues, in a claim's round trip, what wakes the other
	// relays while this one tells writers op (or has told them "busy").
	queueWakeOthers(b *pgx.Batch, op flagOp)
	// read is the claim's statement: up to a batch of rows to publish,
	// leaving out the rows of exclude (a batch whose mark is in flight).
	read(token uuid.UUID, exclude []int64) queries.Statement
	// admit keeps the rows of a read that go into one publish, with the
	// lease each is marked under (nil: the claim token fences them).
	admit(msgs []message) ([]message, []rowLease)
	// overlapsMarks: a batch's mark may run beside the next batch's read.
	overlapsMarks() bool
	// markPublished and markFailed are the statements that record a
	// batch's outcome, fenced as this ownership fences.
	markPublished(m *pendingMark) queries.Statement
	markFailed(f *pendingMark, delays []int64) queries.Statement
	// release gives back rows no attempt was spent on (the broker was
	// unavailable) and returns how many.
	release(ctx context.Context, token uuid.UUID, ids []uuid.UUID, cause error) (int, error)
	// listening is told that the LISTEN connection is (back) up.
	listening()
	// leave ends what this relay owns, on its way out.
	leave()
}

// newOwnership is the ownership named (OwnRows or OwnPartitions).
func newOwnership(r *Relay, name string) ownership {
	if name == OwnPartitions {
		return &partitionLeases{r: r, leases: leases{owner: r.cfg.Name}}
	}
	return rowClaims{r}
}

// chooseOwnership sets the relay's ownership: the one its Config names, or
// for OwnAuto the one resolveOwnership finds (until then, none).
func (r *Relay) chooseOwnership(name string) {
	if name == OwnAuto {
		r.own = nil
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
	if r.own != nil {
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

func (rowClaims) lockModes() (own, other int)        { return 1, 2 }
func (rowClaims) membershipMS() int64                { return 0 }
func (rowClaims) prepare(context.Context) error      { return nil }
func (rowClaims) renewDue() bool                     { return false }
func (rowClaims) renew(context.Context)              {}
func (rowClaims) renewEvery() time.Duration          { return 0 }
func (rowClaims) queueWakeOthers(*pgx.Batch, flagOp) {}
func (rowClaims) overlapsMarks() bool                { return false }
func (rowClaims) listening()                         {}

func (o rowClaims) read(token uuid.UUID, _ []int64) queries.Statement {
	r := o.r
	return queries.RelayClaim(r.batchLimit(), token, r.cfg.Name, r.cfg.RedeliveryWindow().Milliseconds(), r.listener.pid.Load(), r.cfg.BatchBytes)
}

func (rowClaims) admit(msgs []message) ([]message, []rowLease) { return msgs, nil }

func (rowClaims) markPublished(m *pendingMark) queries.Statement {
	return queries.RelayMarkPublished(m.ids, m.streamIDs, m.token)
}

func (o rowClaims) markFailed(f *pendingMark, delays []int64) queries.Statement {
	return queries.RelayMarkFailed(f.ids, f.streamIDs, delays, f.token, o.r.cfg.MaxAttempts)
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
