// Package admin is the operators' API for the outbox table, what the outbox
// command's admin subcommands run and a service may call itself: listing
// and requeueing dead outbox rows (ListDead, RetryDead, RetryAllDead), and
// deleting old published rows (Cleanup). A consumer group's dead letters
// are package admin/dlq's; the end-to-end check of settled TEDs is package
// reconcile.
//
// Every function takes the servers it works on and does one bounded job; the
// command line (internal/cli) parses flags and prints.
package admin

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/internal/queries"
)

// DeadEvent is one dead outbox row, as 'outbox dead list --json' prints it.
type DeadEvent struct {
	EventID       uuid.UUID `json:"event_id"`
	AggregateType string    `json:"aggregate_type"`
	AggregateID   string    `json:"aggregate_id"`
	EventType     string    `json:"event_type"`
	Attempts      int       `json:"attempts"`
	LastError     string    `json:"last_error"` // "" when none was recorded
	CreatedAt     time.Time `json:"created_at"`
}

// ListDead returns up to limit dead events, oldest (lowest seq) first, and the
// number of dead events in all.
func ListDead(ctx context.Context, pool *pgxpool.Pool, limit int) (events []DeadEvent, total int64, err error) {
	return ListDeadOf(ctx, pool, "", limit)
}

// ListDeadOf is ListDead for the events of one aggregate type (every type
// when aggregateType is "").
func ListDeadOf(ctx context.Context, pool *pgxpool.Pool, aggregateType string, limit int) (events []DeadEvent, total int64, err error) {
	if limit <= 0 {
		return nil, 0, fmt.Errorf("list dead events: limit %d must be positive", limit)
	}
	q := queries.AdminDeadList(aggregateType, int64(limit))
	rows, err := pool.Query(ctx, q.SQL, q.Args...)
	if err != nil {
		return nil, 0, fmt.Errorf("list dead events: %w", err)
	}
	defer rows.Close()
	events = []DeadEvent{}
	for rows.Next() {
		var d DeadEvent
		if err := rows.Scan(&d.EventID, &d.AggregateType, &d.AggregateID, &d.EventType,
			&d.Attempts, &d.LastError, &d.CreatedAt, &total); err != nil {
			return nil, 0, fmt.Errorf("list dead events: %w", err)
		}
		events = append(events, d)
	}
	if err := rows.Err(); err != nil {
		return nil, 0, fmt.Errorf("list dead events: %w", err)
	}
	return events, total, nil
}

// NotRequeued is an id RetryDead did not requeue, with the reason.
type NotRequeued struct {
	EventID uuid.UUID
	Status  string // the row's status (pending, publishing, published), or "" if there is no such event
}

func (n NotRequeued) String() string {
	if n.Status == "" {
		return fmt.Sprintf("%s does not exist", n.EventID)
	}
	return fmt.Sprintf("%s is %s, not dead", n.EventID, n.Status)
}

// RetryResult says what RetryDead did.
type RetryResult struct {
	Requeued []uuid.UUID   // dead events now pending again
	Skipped  []NotRequeued // ids that were not dead (or unknown), left alone
}

// RetryDead requeues the dead events among ids: status pending, attempts 0,
// claimable now, last_error and the claim fields cleared. Rows in any other
// status are never touched; they are reported in Skipped. Repeated ids count
// once. It is one statement, so either all the dead ones are requeued or none.
//
// A dead event no longer holds back its aggregate, so newer events of the
// same aggregate may have been published meanwhile: the requeued one then
// reaches the stream after them, out of per-aggregate order.
func RetryDead(ctx context.Context, pool *pgxpool.Pool, ids []uuid.UUID) (RetryResult, error) {
	var res RetryResult
	seen := make(map[uuid.UUID]bool, len(ids))
	uniq := make([]uuid.UUID, 0, len(ids))
	for _, id := range ids {
		if !seen[id] {
			seen[id] = true
			uniq = append(uniq, id)
		}
	}
	if len(uniq) == 0 {
		return res, nil
	}
	var err error
	res.Requeued, res.Skipped, err = requeue(ctx, pool, queries.AdminDeadRetry(uniq))
	if err != nil {
		return RetryResult{}, fmt.Errorf("requeue dead events: %w", err)
	}
	return res, nil
}

// requeue runs st, a statement that puts events back to pending and returns
// each requested id once with whether it did and the row's status before
// (admin_dead_retry.sql, admin_republish.sql), and sorts the ids: done, or
// skipped with their status ("" for no such event).
func requeue(ctx context.Context, pool *pgxpool.Pool, st queries.Statement) (done []uuid.UUID, skipped []NotRequeued, _ error) {
	rows, err := pool.Query(ctx, st.SQL, st.Args...)
	if err != nil {
		return nil, nil, err
	}
	defer rows.Close()
	for rows.Next() {
		var (
			id     uuid.UUID
			ok     bool
			status *string
		)
		if err := rows.Scan(&id, &ok, &status); err != nil {
			return nil, nil, err
		}
		switch {
		case ok:
			done = append(done, id)
		case status == nil:
			skipped = append(skipped, NotRequeued{EventID: id})
		default:
			skipped = append(skipped, NotRequeued{EventID: id, Status: *status})
		}
	}
	return done, skipped, rows.Err()
}

// DefaultRetryBatch is how many dead rows RetryAllDead requeues per statement.
const DefaultRetryBatch = 1000

// RetryAllDead requeues every dead event, in seq order, batch rows per
// statement (each its own short transaction), and returns how many it
// requeued. A row that dies again while it runs is not requeued a second
// time, so it always ends. On error, the count is what earlier batches
// requeued (they stay requeued).
func RetryAllDead(ctx context.Context, pool *pgxpool.Pool, batch int) (int64, error) {
	if batch <= 0 {
		batch = DefaultRetryBatch
	}
	var total, after int64
	for {
		var n int64
		q := queries.AdminDeadRetryAll(after, int64(batch))
		if err := pool.QueryRow(ctx, q.SQL, q.Args...).Scan(&n, &after); err != nil {
			return total, fmt.Errorf("requeue dead events (after %d requeued): %w", total, err)
		}
		total += n
		if n < int64(batch) {
			return total, nil
		}
	}
}
