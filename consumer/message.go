package consumer

import (
	"context"
	"errors"
	"fmt"
	"github.com/tedbank/outbox/consumer/source"
	"github.com/tedbank/outbox/internal/redischeck"
	"time"

	"github.com/google/uuid"

	"github.com/tedbank/outbox/relay/entry"
)

// Message is one delivery of an event, as the relay published it.
type Message struct {
	ID            uuid.UUID // the event id: the key of its dedupe record
	Type          string    // the event type ("transfer.settled")
	AggregateType string
	AggregateID   string
	// Key is the event's partition key, its unit of order: a handler keeps
	// the messages of one key in order (see Handler). Empty when the entry
	// does not carry one (written before relays did): such a message is
	// ordered after every earlier message, whatever its key.
	Key        string
	Payload    []byte    // as written to the outbox
	Headers    []byte    // a JSON object of strings (a W3C traceparent when tracing is on)
	OccurredAt time.Time // when the outbox row was written (zero if the entry does not say)
	EntryID    string    // the stream entry's id
	Partition  int       // the partition it was read from
	Attempt    int64     // its delivery count: 1 on the first delivery
}

// Batch is the messages of one partition that one read returned, in stream
// order.
type Batch struct {
	Partition int
	// Stream is the partition's stream. On a Redis Cluster its hash slot is
	// the one of every key under Keys.
	Stream string
	// Keys are the partition's keys (a handler keeping its state in Redis
	// puts its keys under Keys.Prefix, so they share the slot).
	Keys Keys
	// Fence is the partition's lease value that the effects must find
	// (Keys.Lease(group)) for this consumer to still own the partition; an
	// effect that finds another refuses and reports ErrFenced. Empty when
	// the batch is applied without partition ownership (the tests' single
	// steps, internal/consumertest).
	Fence string
	// Group is the consumer group.
	Group    string
	Messages []Message
}

// Outcomes every handler shares; a handler may report others (anti-fraud
// reports its verdict), which the metrics count by name.
const (
	// Duplicate: the message's effect was applied before (its dedupe record
	// exists); nothing was applied this time.
	Duplicate = "duplicate"
	// Applied: the message's effect was applied now.
	Applied = "applied"
)

// Result is what became of one message of a Batch.
type Result struct {
	// Outcome names what was done (Applied, Duplicate, or the handler's
	// own name for it) when Err is nil.
	Outcome string
	// Err, when set, leaves the message pending. If it wraps ErrInvalid
	// the message can never be applied: it is dead-lettered at its
	// MaxDeliveries-th delivery. If it wraps ErrFenced the consumer lost
	// the partition and stops applying it. Otherwise the failure is
	// transient (a store down, a timeout) and the message is retried, with
	// backoff, however often it is delivered.
	Err error
}

// Handler applies the effects of a batch of messages, each exactly once: a
// message delivered again must find the record its first effect left and
// come back Duplicate. It returns one Result per message, in order.
//
// It keeps each key's order: the messages of one Key take effect in batch
// order, and once a message fails (any error but ErrInvalid), no later
// message of its key may take effect in this batch: report those held
// (Held, with an Order to track the failed keys), and the consumer delivers
// them again after the failed one. The consumer does the same across
// batches: while a message of a key is pending for a retry, no later
// message of that key reaches the handler. Handle
// runs on the goroutine of the batch's partition (with several partitions,
// concurrently) and must finish even when ctx is cancelled. Inbox (the
// effect in a PostgreSQL transaction with the event id in an inbox table)
// and RunScripts (Lua scripts that check and set a marker in Redis) are the
// two ways this package offers to make an effect exactly-once.
type Handler interface {
	Handle(ctx context.Context, b Batch) []Result
}

// Deduper is a Handler that keeps its dedupe records for a time: New
// rejects a time shorter than a message can be delivered again
// (Config.CheckDedupeWindow).
type Deduper interface {
	DedupeTTL() time.Duration
}

// Maintainer is a Handler with work of its own to do while the consumer
// runs (the inbox deletes the records past their retention): Run calls
// Maintain in a goroutine of its own and waits for it to return after ctx
// is cancelled.
type Maintainer interface {
	Maintain(ctx context.Context)
}

// HandlerFunc is a Handler made of a function.
type HandlerFunc func(ctx context.Context, b Batch) []Result

// Handle calls f.
func (f HandlerFunc) Handle(ctx context.Context, b Batch) []Result { return f(ctx, b) }

var (
	// ErrInvalid is wrapped by the error of a message that can never be
	// applied (it does not decode): it is dead-lettered.
	ErrInvalid = errors.New("invalid event")
	// ErrFenced is wrapped by the error of an effect refused because the
	// partition's lease no longer holds this consumer's value (or a
	// Source found a newer owner: it is source.ErrFenced).
	ErrFenced = source.ErrFenced
	// ErrEvictingRedis is wrapped by Run's error when the Redis it works
	// with evicts keys under memory pressure (Config.AllowEvictingRedis).
	ErrEvictingRedis = redischeck.ErrEvicting
)

// Invalid returns an error that wraps ErrInvalid.
func Invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalid, fmt.Sprintf(format, args...))
}

// DecodeEntry decodes the fields of a stream entry the relay wrote (package
// relay/entry). Its errors wrap ErrInvalid.
func DecodeEntry(id string, values map[string]any) (Message, error) {
	if values == nil {
		return Message{}, Invalid("entry %s has no fields (deleted or trimmed)", id)
	}
	str := func(k string, required bool) (string, error) {
		v, ok := values[k]
		if !ok {
			if required {
				return "", Invalid("missing field %q", k)
			}
			return "", nil
		}
		s, ok := v.(string)
		if !ok {
			return "", Invalid("field %q is not a string", k)
		}
		return s, nil
	}
	var m Message
	var rawID, occurred, payload, headers string
	var err error
	for _, f := range []struct {
		name     string
		to       *string
		required bool
	}{
		{entry.EventID, &rawID, true}, {entry.EventType, &m.Type, true}, {entry.Payload, &payload, true},
		{entry.AggregateType, &m.AggregateType, false}, {entry.AggregateID, &m.AggregateID, false},
		{entry.Headers, &headers, false}, {entry.OccurredAt, &occurred, false},
		{entry.PartitionKey, &m.Key, false},
	} {
		if *f.to, err = str(f.name, f.required); err != nil {
			return Message{}, err
		}
	}
	if m.ID, err = uuid.Parse(rawID); err != nil {
		return Message{}, Invalid("event_id %q is not a UUID", rawID)
	}
	if occurred != "" {
		if m.OccurredAt, err = time.Parse(time.RFC3339Nano, occurred); err != nil {
			return Message{}, Invalid("occurred_at %q is not an RFC 3339 time", occurred)
		}
	}
	m.Payload, m.Headers, m.EntryID = []byte(payload), []byte(headers), id
	return m, nil
}
