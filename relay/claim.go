package relay

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/tedbank/outbox/internal/failpoint"
	"github.com/tedbank/outbox/internal/queries"
)

// claim claims one batch under token. In the same round trip it first tells
// writers what op says and marks prev published (it returns how many of
// prev's rows that mark updated).
func (r *Relay) claim(ctx context.Context, op flagOp, token uuid.UUID, prev *pendingMark) (_ []message, marked int, slept bool, _ error) {
	var (
		msgs []message
		b    pgx.Batch
	)
	queueRelayTx(&b)
	var injected error
	if op == flagBusy {
		injected = failpoint.Error("relay.after-busy")
	}
	if injected != nil {
		// Crash tests: a slow round trip (a pool wait, a lock) that says
		// "busy" late and then fails, as a terminated backend would make
		// it. The flag stays 0 (a sequence); the mark and claim roll back.
		b.Queue("SELECT pg_sleep(0.3)")
	}
	switch op {
	case flagBusy:
		queue(&b, queries.RelayBusy(r.listener.pid.Load()))
	case flagSleep:
		queue(&b, queries.RelaySleep()).QueryRow(func(row pgx.Row) error { return row.Scan(&slept) })
	}
	if l := r.own.leases; l != nil {
		l.queueWakeOthers(&b, op)
	}
	if prev != nil {
		queue(&b, prev.fence.published(prev)).Exec(func(tag pgconn.CommandTag) error {
			marked = int(tag.RowsAffected())
			return nil
		})
	}
	keepFloor := r.loop.floor.queue(&b, time.Now(), r.loop.lastRead >= max(1, r.batchLimit()/2))
	b.Queue(indexedClaim)
	queue(&b, r.own.read(token)).Query(func(rows pgx.Rows) error {
		var err error
		msgs, err = pgx.CollectRows(rows, pgx.RowToStructByName[message])
		return err
	})
	if injected != nil {
		b.Queue("SELECT $1::text::int", injected.Error())
	}
	r.stats.claims.Add(1)
	if err := r.sendTx(ctx, &b); err != nil {
		return nil, 0, false, fmt.Errorf("claim: %w", err)
	}
	if keepFloor() {
		r.stats.floorPassedOver.Add(1)
	}
	r.loop.lastRead = len(msgs)
	if len(msgs) > 0 {
		r.loop.held.add(token)
	}
	return msgs, marked, slept, nil
}

// heldClaims is the claim tokens of the relay's latest claims that returned
// rows: every batch it still holds is among them (a batch in flight and the
// one whose mark rides with the next claim). A relay back on a new LISTEN
// backend restamps those claims alone (relay_restamp.sql).
type heldClaims struct {
	mu     sync.Mutex
	tokens [8]uuid.UUID
	next   int
}

func (h *heldClaims) add(token uuid.UUID) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.tokens[h.next%len(h.tokens)] = token
	h.next++
}

func (h *heldClaims) list() []uuid.UUID {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.DeleteFunc(slices.Clone(h.tokens[:]), func(t uuid.UUID) bool { return t == uuid.Nil })
}

// queueRelayTx queues the statements that open every relay transaction:
// beginReadCommitted, then asyncCommit. sendTx closes it.
func queueRelayTx(b *pgx.Batch) {
	b.Queue(beginReadCommitted)
	b.Queue(asyncCommit)
}

// sendTx commits the transaction queueRelayTx opened and sends the batch in
// one round trip. When a statement fails, the rest (the COMMIT included) is
// skipped and the transaction rolls back; the connection, left in a failed
// transaction block, is closed by the pool when it is released.
func (r *Relay) sendTx(ctx context.Context, b *pgx.Batch) error {
	b.Queue("COMMIT")
	return r.pool.roundTrip(func() error { return r.pool.SendBatch(ctx, b).Close() })
}

// indexedClaim keeps the claim on its partial indexes, walked in seq order,
// whatever the table's statistics say. Statistics taken while the outbox was
// empty (a new database, or an idle outbox: the usual state) estimate one
// pending row, and the planner then probed the per-aggregate gate with a
// sequential scan per pending row: with a backlog of thousands, one claim
// took 10 s of CPU (found by outbox bench writers on fresh databases; after
// an outage, the backlog is exactly when the claim must be fast). With the
// same estimate it also chose a bitmap scan of every pending row, the key
// checks for each and a sort, over an ordered scan that stops at the batch:
// 1.8 s a read over 116,000 pending rows not yet analyzed, against 10 ms
// (outbox bench latency --hold-horizon, docs/log.md;
// TestBacklogUnderStaleStatisticsIsReadInOrder). Transaction-local.
//
// Without JIT, too: a read's per-row key checks (migration 0022) put its
// estimated cost over jit_above_cost, and compiling the plan took 0.4 s
// of every 8 ms read of a backlog (outbox bench drain with partition
// leases: 0.21 of the minimal relay instead of 0.97). A claim is an
// index walk of at most a batch; JIT never pays for itself here.
const indexedClaim = "SELECT set_config('enable_seqscan', 'off', true), set_config('enable_bitmapscan', 'off', true), set_config('jit', 'off', true)"

// beginReadCommitted: the wake-up protocol needs READ COMMITTED, whatever the
// database's or role's default_transaction_isolation. The claim after
// outbox_relay_sleep must see the rows of writers that committed while it
// waited for them; under REPEATABLE READ or SERIALIZABLE its snapshot would
// date from before the wait. (Claims under those levels would also fail with
// serialization errors against other relays.) An explicit transaction block:
// SET TRANSACTION in the implicit transaction of a pipeline works too, but
// PostgreSQL logs a WARNING for each one, one per relay round trip (found
// in the server log after a benchmark: 52,000 lines). It costs no round
// trip, being queued in the batch with its COMMIT (sendTx).
const beginReadCommitted = "BEGIN ISOLATION LEVEL READ COMMITTED"

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

// exec runs one relay write with asyncCommit, in one round trip (again on a
// fresh connection when the server closed the pooled one: onFresh).
func (r *Relay) exec(ctx context.Context, st queries.Statement) (pgconn.CommandTag, error) {
	return r.execFrom(ctx, nil, st)
}

// execFrom is exec with floor's statement first (nil: none), so that st
// reads from it (outbox_relay_read_from).
func (r *Relay) execFrom(ctx context.Context, floor *readFloor, st queries.Statement) (pgconn.CommandTag, error) {
	var tag pgconn.CommandTag
	err := r.onFresh(func() error {
		var b pgx.Batch
		queueRelayTx(&b)
		keep := func() bool { return false }
		if floor != nil {
			keep = floor.queue(&b, time.Now(), true)
		}
		queue(&b, st).Exec(func(t pgconn.CommandTag) error { tag = t; return nil })
		if err := r.sendTx(ctx, &b); err != nil {
			return err
		}
		keep()
		return nil
	})
	return tag, err
}

// queryRow runs st on the pool and scans its one row into dest.
func (r *Relay) queryRow(ctx context.Context, st queries.Statement, dest ...any) error {
	return r.pool.roundTrip(func() error { return r.pool.QueryRow(ctx, st.SQL, st.Args...).Scan(dest...) })
}

// queue adds st to b.
func queue(b *pgx.Batch, st queries.Statement) *pgx.QueuedQuery { return b.Queue(st.SQL, st.Args...) }

// execIn and queryRowIn run st in tx.
func execIn(ctx context.Context, tx pgx.Tx, st queries.Statement) (pgconn.CommandTag, error) {
	return tx.Exec(ctx, st.SQL, st.Args...)
}

func queryRowIn(ctx context.Context, tx pgx.Tx, st queries.Statement) pgx.Row {
	return tx.QueryRow(ctx, st.SQL, st.Args...)
}
