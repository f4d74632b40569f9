package admin

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/internal/queries"
)

// Action is an operator's action recorded in outbox_operator_actions
// (migration 0020): what the console writes after it requeued something.
type Action struct {
	ID     int64     `json:"id"`
	At     time.Time `json:"at"`
	Actor  string    `json:"actor"`  // who, as the person gave it
	Origin string    `json:"origin"` // where the request came from (the console: its remote address)
	Kind   string    `json:"action"` // ActionDeadRetry or ActionDLQRetry
	Target string    `json:"target"` // the event id, or the dead letter's id and stream
	Reason string    `json:"reason"` // why
	// Outcome is what the action did ("requeued", "retried to <stream> as
	// <id>", ...).
	Outcome string `json:"outcome"`
}

// The kinds of Action.
const (
	ActionDeadRetry = "dead_retry" // a dead outbox event put back to pending (RetryDead)
	ActionDLQRetry  = "dlq_retry"  // a consumer's dead letter put back on its stream (dlq.Retry)
)

// ErrAuditField: an audit record's actor, reason or target is empty or too
// long (200, 1,000 and 500 characters).
var ErrAuditField = errors.New("audit record")

// Record writes a and returns it with its id and time.
func Record(ctx context.Context, pool *pgxpool.Pool, a Action) (Action, error) {
	switch {
	case len(a.Actor) == 0 || len(a.Actor) > 200:
		return a, fmt.Errorf("%w: who did it: 1 to 200 characters", ErrAuditField)
	case len(a.Reason) == 0 || len(a.Reason) > 1000:
		return a, fmt.Errorf("%w: why: 1 to 1000 characters", ErrAuditField)
	case len(a.Target) == 0 || len(a.Target) > 500:
		return a, fmt.Errorf("%w: the target: 1 to 500 characters", ErrAuditField)
	case len(a.Origin) > 200 || len(a.Outcome) > 1000:
		return a, fmt.Errorf("%w: origin or outcome too long", ErrAuditField)
	}
	q := queries.AdminAuditInsert(a.Actor, a.Origin, a.Kind, a.Target, a.Reason, a.Outcome)
	if err := pool.QueryRow(ctx, q.SQL, q.Args...).Scan(&a.ID, &a.At); err != nil {
		return a, fmt.Errorf("record the operator's action: %w", err)
	}
	return a, nil
}

// Actions returns the last limit recorded actions, newest first.
func Actions(ctx context.Context, pool *pgxpool.Pool, limit int) ([]Action, error) {
	q := queries.AdminAuditList(int64(max(limit, 1)))
	rows, err := pool.Query(ctx, q.SQL, q.Args...)
	if err != nil {
		return nil, fmt.Errorf("read the operators' actions: %w", err)
	}
	defer rows.Close()
	actions := []Action{}
	for rows.Next() {
		var a Action
		if err := rows.Scan(&a.ID, &a.At, &a.Actor, &a.Origin, &a.Kind, &a.Target, &a.Reason, &a.Outcome); err != nil {
			return nil, fmt.Errorf("read the operators' actions: %w", err)
		}
		actions = append(actions, a)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read the operators' actions: %w", err)
	}
	return actions, nil
}
