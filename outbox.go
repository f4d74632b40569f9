// Package outbox is the write side of a transactional outbox on PostgreSQL.
//
// Write inserts events into outbox_messages inside the caller's pgx.Tx, so an
// event is committed if and only if the business change it describes is. The
// relay package publishes committed events to Redis Streams; the fraud package
// is an example consumer. Use Write for any aggregate and event type:
//
//	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
//		if _, err := tx.Exec(ctx, "UPDATE accounts SET ..."); err != nil {
//			return err
//		}
//		_, err := outbox.Write(ctx, tx, outbox.Message{
//			AggregateType: "account",
//			AggregateID:   accountID,
//			EventType:     "account.credited",
//			Payload:       payloadJSON,
//		})
//		return err
//	})
//
// Delivery downstream is at least once: consumers deduplicate on the event id.
package outbox

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"regexp"
	"slices"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"

	"github.com/tedbank/outbox/internal/queries"
	"github.com/tedbank/outbox/internal/tracing"
	"github.com/tedbank/outbox/partition"
)

// Message is one event to write to the outbox.
type Message struct {
	// ID is the event id consumers deduplicate on. Zero means a new UUIDv7
	// (time-ordered, which keeps the primary key index compact).
	ID uuid.UUID
	// AggregateType names the kind of entity, e.g. "transfer". It selects the
	// Redis stream (outbox.event.<aggregate_type> by default), so it must match
	// AggregateTypePattern.
	AggregateType string
	// AggregateID identifies the entity. Events of one aggregate are published
	// in the order they were written.
	AggregateID string
	// EventType names what happened, e.g. "transfer.settled".
	EventType string
	// Payload is the event body, a JSON document.
	Payload json.RawMessage
	// PartitionKey is the unit of order downstream: events with one
	// partition key are meant to reach consumers in the order they were
	// written. Empty means the aggregate id. transfer.settled uses the
	// sender account, so one sender's TEDs stay in settled order.
	PartitionKey string
	// Headers are optional metadata sent along with the event. When ctx
	// carries a trace and Headers has no traceparent, Write adds the W3C
	// trace context, so consumers continue the caller's trace.
	Headers map[string]string
}

// AggregateTypePattern is what an aggregate type must match; the database
// enforces the same rule with a CHECK constraint.
var AggregateTypePattern = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,100}$`)

// ErrInvalidMessage is wrapped by every error Write returns for a message
// that cannot be written; nothing is written in that case.
var ErrInvalidMessage = errors.New("invalid outbox message")

// Validate reports why m cannot be written, or nil.
func (m Message) Validate() error {
	switch {
	case !AggregateTypePattern.MatchString(m.AggregateType):
		return fmt.Errorf("%w: aggregate type %q must match %s", ErrInvalidMessage, m.AggregateType, AggregateTypePattern)
	case m.AggregateID == "" || len(m.AggregateID) > 200:
		return fmt.Errorf("%w: aggregate id must have 1 to 200 bytes", ErrInvalidMessage)
	case len(m.PartitionKey) > 200:
		return fmt.Errorf("%w: partition key must have at most 200 bytes", ErrInvalidMessage)
	case m.EventType == "" || len(m.EventType) > 200:
		return fmt.Errorf("%w: event type must have 1 to 200 bytes", ErrInvalidMessage)
	case !json.Valid(m.Payload):
		return fmt.Errorf("%w: payload of %s is not valid JSON", ErrInvalidMessage, m.EventType)
	}
	return nil
}

// Written describes one row Write inserted.
type Written struct {
	ID  uuid.UUID // the event id
	Seq int64     // its position in the outbox's publication order
}

// Write inserts msgs into outbox_messages in tx, in one statement, and returns
// the event ids in the order of msgs. The rows become visible (and the relay is
// notified) only when tx commits.
//
// Events of one aggregate type and partition key are published in seq order,
// which is the order they were inserted, and that is the order they were
// committed: before inserting, Write takes a transaction-scoped lock on each
// partition key's lock slot (one of LockSlots, by hash), so a second
// transaction writing the same key waits at its Write until the first one
// commits or rolls back. Keep transactions short after Write: the lock is held
// to the end. A plain INSERT into outbox_messages takes no such lock; two of
// them for one key must be serialized by the caller (e.g. by locking the
// aggregate's row first), or the later one may commit, and be published,
// first. Messages of one call are inserted grouped by aggregate.
func Write(ctx context.Context, tx pgx.Tx, msgs ...Message) ([]Written, error) {
	if len(msgs) == 0 {
		return nil, nil
	}
	n := len(msgs)
	order := make([]int, n)
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int {
		return cmp.Or(
			cmp.Compare(msgs[a].AggregateType, msgs[b].AggregateType),
			cmp.Compare(msgs[a].AggregateID, msgs[b].AggregateID))
	})

	var (
		ids      = make([]uuid.UUID, n)
		aggTypes = make([]string, n)
		aggIDs   = make([]string, n)
		types    = make([]string, n)
		payloads = make([]string, n)
		headers  = make([]string, n)
		parts    = make([]string, n)
	)
	for pos, i := range order {
		m := msgs[i]
		if err := m.Validate(); err != nil {
			return nil, fmt.Errorf("message %d: %w", i, err)
		}
		if m.ID == uuid.Nil {
			id, err := uuid.NewV7()
			if err != nil {
				return nil, fmt.Errorf("new event id: %w", err)
			}
			m.ID = id
		}
		hdrs := m.Headers
		if _, ok := hdrs[tracing.HeaderTraceparent]; !ok && trace.SpanContextFromContext(ctx).IsValid() {
			// Carry the caller's trace to the consumers.
			hdrs = maps.Clone(hdrs)
			if hdrs == nil {
				hdrs = map[string]string{}
			}
			tracing.Inject(ctx, hdrs)
		}
		h := []byte("{}")
		if len(hdrs) > 0 {
			var err error
			if h, err = json.Marshal(hdrs); err != nil {
				return nil, fmt.Errorf("message %d: headers: %w", i, err)
			}
		}
		ids[pos], aggTypes[pos], aggIDs[pos], types[pos] = m.ID, m.AggregateType, m.AggregateID, m.EventType
		payloads[pos], headers[pos], parts[pos] = string(m.Payload), string(h), m.PartitionKey
	}

	var (
		b        pgx.Batch
		inserted []Written
	)
	lock := queries.OutboxLockPartitions(lockSlots(aggTypes, aggIDs, parts))
	insert := queries.OutboxInsert(ids, aggTypes, aggIDs, types, payloads, headers, parts)
	b.Queue(lock.SQL, lock.Args...)
	b.Queue(insert.SQL, insert.Args...).Query(func(rows pgx.Rows) error {
		var err error
		inserted, err = pgx.CollectRows(rows, pgx.RowToStructByName[Written])
		return err
	})
	if err := tx.SendBatch(ctx, &b).Close(); err != nil {
		return nil, fmt.Errorf("insert outbox messages: %w", err)
	}
	if len(inserted) != n {
		return nil, fmt.Errorf("insert outbox messages: inserted %d rows, want %d", len(inserted), n)
	}
	seqOf := make(map[uuid.UUID]int64, n)
	for _, w := range inserted {
		seqOf[w.ID] = w.Seq
	}
	out := make([]Written, n)
	for pos, i := range order {
		out[i] = Written{ID: ids[pos], Seq: seqOf[ids[pos]]}
	}
	return out, nil
}

// LockSlots is how many lock slots the partition keys hash to (Write).
const LockSlots = 256

// lockSlots returns the distinct lock slots of the messages' partition keys
// (the aggregate id when empty), ascending.
func lockSlots(aggTypes, aggIDs, parts []string) []int32 {
	slots := make([]int32, 0, min(len(parts), LockSlots))
	for i := range parts {
		key := cmp.Or(parts[i], aggIDs[i])
		slots = append(slots, int32(partition.Of(aggTypes[i]+"/"+key, LockSlots)))
	}
	slices.Sort(slots)
	return slices.Compact(slots)
}

// RegisterTypes tells conn which PostgreSQL types the uuid values the outbox
// sends are, for when a statement's parameter types are not known: pgx's
// exec and simple-protocol modes (default_query_exec_mode=exec), which a
// pooler in transaction mode such as PgBouncer needs, as no prepared
// statement survives from one transaction to the next. Set it as the pool's
// AfterConnect (pgxpool.Config.AfterConnect); the default mode, prepared
// statements, does not need it. The outbox command's connections always
// have it.
func RegisterTypes(_ context.Context, conn *pgx.Conn) error {
	m := conn.TypeMap()
	m.RegisterDefaultPgType(uuid.UUID{}, "uuid")
	m.RegisterDefaultPgType([]uuid.UUID{}, "_uuid")
	return nil
}
