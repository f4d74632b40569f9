package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tedbank/outbox/internal/queries"
	"github.com/tedbank/outbox/internal/retry"
)

// Relays of the two ownerships must never share a database: a claimer's
// 'publishing' row does not hold back a partition owner's read of the next
// event of its key (nor an owner's lease a claimer's claim), so side by side
// they would publish a key's events out of order. Each relay says which
// ownership it runs with a shared session advisory lock on its LISTEN
// connection (released by PostgreSQL the moment the connection closes: a
// dead relay says nothing any more), and checks that no relay holds the
// other one's: when it starts, and after each (re)connection of its LISTEN
// connection, which catches two relays of different ownerships started at
// once.
//
// A relay leasing partitions that finds no claimer alive returns every
// 'publishing' row to pending at once (partitionLeases.prepare, partitions.go): those are a dead
// claimer's, left from before a switch of ownership, and as pending rows
// with an attempt counted they hold back the later events of their keys
// (relay_read.sql), where as 'publishing' rows they would not.

// ownershipSettle is how long a relay looks again for the other ownership's
// lock before it refuses (a relay that just stopped still holds it until
// its backend has exited).
const ownershipSettle = 3 * time.Second

// ErrMixedOwnership: a relay of the other ownership (row claims, partition
// leases) runs on this database. Run returns it.
var ErrMixedOwnership = errors.New("relays of both ownerships on one database")

// holdOwnership takes this relay's ownership lock for the life of conn's
// session.
func (r *Relay) holdOwnership(ctx context.Context, conn *pgx.Conn) error {
	own, _ := r.own.lockModes()
	st := queries.RelayOwnershipHold(own)
	var v any
	if err := conn.QueryRow(ctx, st.SQL, st.Args...).Scan(&v); err != nil {
		return fmt.Errorf("hold the ownership lock: %w", err)
	}
	return nil
}

// checkOwnership reports ErrMixedOwnership when a registered relay of the
// other ownership holds its lock.
func (r *Relay) checkOwnership(ctx context.Context, exec func(ctx context.Context, st queries.Statement, dest ...any) error) error {
	_, other := r.own.lockModes()
	// A relay that just stopped holds its lock until its backend has
	// exited, a moment after its connection closed: look again for a
	// little while before refusing.
	var free bool
	for deadline := time.Now().Add(ownershipSettle); ; {
		if err := exec(ctx, queries.RelayOwnershipOther(other), &free); err != nil {
			return fmt.Errorf("check for relays of the other ownership: %w", err)
		}
		if free || time.Now().After(deadline) {
			break
		}
		retry.Sleep(ctx, 100*time.Millisecond)
		if err := ctx.Err(); err != nil {
			return err
		}
	}
	if !free {
		theirs := OwnPartitions
		if other == 1 {
			theirs = OwnRows
		}
		return fmt.Errorf("%w: this relay's ownership is %q, and a relay of ownership %q runs on this database "+
			"(both would publish a key's events out of order): run every relay with one --ownership; to switch, stop them all first",
			ErrMixedOwnership, r.Ownership(), theirs)
	}
	return nil
}

// refuseMixedOwnership is the check when Run starts, on a pooled
// connection: a database that does not answer yet is checked again once the
// LISTEN connection reaches it.
func (r *Relay) refuseMixedOwnership(ctx context.Context) error {
	err := r.checkOwnership(ctx, r.queryRow)
	if err != nil && !errors.Is(err, ErrMixedOwnership) {
		r.log.Warn("could not check for relays of the other ownership; checking once listening", slog.Any("error", err))
		return nil
	}
	return err
}
