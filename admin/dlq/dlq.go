// Package dlq lists and replays the entries a consumer group moved to its
// dead-letter stream (fraud/deadletter.lua): what 'outbox fraud dlq list'
// and 'outbox fraud dlq retry' run. The outbox's own dead rows are
// package admin's.
package dlq

import (
	"cmp"
	"context"
	_ "embed"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/partition"
)

var (
	//go:embed retry.lua
	dlqRetrySrc    string
	dlqRetryScript = redis.NewScript(dlqRetrySrc)
)

// DeadLetter is one entry of the anti-fraud consumer's dead-letter stream
// (<key prefix>dlq), as 'outbox fraud dlq list --json' prints it.
type DeadLetter struct {
	// ID is the entry's id in the dead-letter stream: what 'fraud dlq retry' takes.
	ID          string `json:"id"`
	EventID     string `json:"event_id"`     // the original entry's event_id ("" if it had none)
	EventType   string `json:"event_type"`   // the original entry's event_type
	AggregateID string `json:"aggregate_id"` // the original entry's aggregate_id
	// The dlq_* fields fraud/deadletter.lua appends.
	Stream     string `json:"dlq_stream"`     // the source stream
	Group      string `json:"dlq_group"`      // the consumer group that gave up
	EntryID    string `json:"dlq_entry_id"`   // the entry's id in the source stream
	Reason     string `json:"dlq_reason"`     // why it could not be processed
	Deliveries int64  `json:"dlq_deliveries"` // how often it was delivered
	Consumer   string `json:"dlq_consumer"`   // the consumer that moved it
	// Fields are the original fields (every field but the dlq_* ones): what
	// a retry re-adds to the source stream.
	Fields map[string]string `json:"fields"`
}

func deadLetter(m redis.XMessage) DeadLetter {
	d := DeadLetter{ID: m.ID, Fields: map[string]string{}}
	for k, v := range m.Values {
		s, _ := v.(string)
		switch k {
		case "dlq_stream":
			d.Stream = s
		case "dlq_group":
			d.Group = s
		case "dlq_entry_id":
			d.EntryID = s
		case "dlq_reason":
			d.Reason = s
		case "dlq_deliveries":
			d.Deliveries, _ = strconv.ParseInt(s, 10, 64)
		case "dlq_consumer":
			d.Consumer = s
		default:
			if !strings.HasPrefix(k, "dlq_") {
				d.Fields[k] = s
			}
		}
	}
	d.EventID, d.EventType, d.AggregateID = d.Fields["event_id"], d.Fields["event_type"], d.Fields["aggregate_id"]
	return d
}

// Stream is the dead-letter stream of the consumers writing under keyPrefix.
func Stream(keyPrefix string) string { return fraud.Keys{Prefix: keyPrefix}.DeadLetters() }

// List returns up to count dead letters of the consumers writing
// under keyPrefix, oldest first, and the length of the dead-letter stream.
func List(ctx context.Context, rdb redis.Cmdable, keyPrefix string, count int) (letters []DeadLetter, total int64, err error) {
	if count <= 0 {
		return nil, 0, fmt.Errorf("list dead letters: count %d must be positive", count)
	}
	dlq := Stream(keyPrefix)
	msgs, err := rdb.XRangeN(ctx, dlq, "-", "+", int64(count)).Result()
	if err != nil {
		return nil, 0, fmt.Errorf("list dead letters in %s: %w", dlq, err)
	}
	if total, err = rdb.XLen(ctx, dlq).Result(); err != nil {
		return nil, 0, fmt.Errorf("list dead letters in %s: %w", dlq, err)
	}
	letters = make([]DeadLetter, len(msgs))
	for i, m := range msgs {
		letters[i] = deadLetter(m)
	}
	return letters, total, nil
}

var streamIDPattern = regexp.MustCompile(`^[0-9]{1,20}-[0-9]{1,20}$`)

// ValidEntryID reports whether id is a complete stream entry id (ms-seq).
func ValidEntryID(id string) bool { return streamIDPattern.MatchString(id) }

// Retried is a dead letter put back on its source stream.
type Retried struct {
	ID     string // its id in the dead-letter stream (now deleted)
	Stream string // the stream it was re-added to
	NewID  string // its new id there
}

// Failure is a dead letter that could not be retried; it stays in the
// dead-letter stream.
type Failure struct {
	ID  string
	Err error
}

// RetryResult says what Retry or RetryAll did.
type RetryResult struct {
	Retried []Retried
	Missing []string  // ids not in the dead-letter stream (unknown, or already retried)
	Failed  []Failure // dead letters Redis refused to move (e.g. no original fields)
}

// Retry puts the given dead letters back on their source stream:
// for each, one Lua script re-adds its original fields (not the dlq_* ones)
// under a new id to the stream named by its dlq_stream field (fallbackStream
// if it has none) and deletes it from the dead-letter stream, atomically. The
// consumer group then reads it as a new entry; its dedupe on event_id makes a
// replay of an event already applied harmless. Repeated ids count once.
//
// An id that is not in the dead-letter stream is reported in Missing; one
// that Redis refuses to move, in Failed. It returns an error, and the result
// so far, when Redis fails otherwise.
func Retry(ctx context.Context, rdb redis.Cmdable, keyPrefix string, ids []string, fallbackStream string) (RetryResult, error) {
	var res RetryResult
	if fallbackStream == "" {
		return res, errors.New("retry dead letters: no fallback stream")
	}
	dlq := Stream(keyPrefix)
	seen := map[string]bool{}
	for _, id := range ids {
		if seen[id] {
			continue
		}
		seen[id] = true
		if !ValidEntryID(id) {
			return res, fmt.Errorf("retry dead letters: %q is not a stream entry id (ms-seq)", id)
		}
		msgs, err := rdb.XRange(ctx, dlq, id, id).Result()
		if err != nil {
			return res, fmt.Errorf("retry dead letter %s: read %s: %w", id, dlq, err)
		}
		if len(msgs) == 0 {
			res.Missing = append(res.Missing, id)
			continue
		}
		if err := retryOne(ctx, rdb, dlq, msgs[0], fallbackStream, &res); err != nil {
			return res, err
		}
	}
	return res, nil
}

// RetryAll retries, as Retry does, every entry the
// dead-letter stream holds when it starts (entries dead-lettered while it runs,
// including retried ones that fail again, are left for the next run).
func RetryAll(ctx context.Context, rdb redis.Cmdable, keyPrefix, fallbackStream string) (RetryResult, error) {
	var res RetryResult
	if fallbackStream == "" {
		return res, errors.New("retry dead letters: no fallback stream")
	}
	dlq := Stream(keyPrefix)
	last, err := rdb.XRevRangeN(ctx, dlq, "+", "-", 1).Result()
	if err != nil {
		return res, fmt.Errorf("retry dead letters: read %s: %w", dlq, err)
	}
	if len(last) == 0 {
		return res, nil
	}
	const page = 100
	start := "-"
	for {
		msgs, err := rdb.XRangeN(ctx, dlq, start, last[0].ID, page).Result()
		if err != nil {
			return res, fmt.Errorf("retry dead letters: read %s: %w", dlq, err)
		}
		for _, m := range msgs {
			if err := retryOne(ctx, rdb, dlq, m, fallbackStream, &res); err != nil {
				return res, err
			}
		}
		if len(msgs) < page {
			return res, nil
		}
		start = "(" + msgs[len(msgs)-1].ID
	}
}

// errFromNATS: the dead letter came from NATS JetStream (dlq_broker=nats):
// re-adding it to a Redis stream would reach no consumer.
var errFromNATS = errors.New("dead-lettered from NATS JetStream (dlq_broker=nats): a retry re-adds to Redis Streams only; " +
	"publish the event again from its outbox row (back to pending, once the JetStream stream's duplicate window has passed)")

func retryOne(ctx context.Context, rdb redis.Cmdable, dlq string, m redis.XMessage, fallbackStream string, res *RetryResult) error {
	if b, _ := m.Values["dlq_broker"].(string); b == "nats" {
		res.Failed = append(res.Failed, Failure{ID: m.ID, Err: errFromNATS})
		return nil
	}
	source := fallbackStream
	if s, ok := m.Values["dlq_stream"].(string); ok {
		source = s
	}
	newID, err := dlqRetryScript.Run(ctx, rdb, []string{dlq, source}, m.ID, fallbackStream).Text()
	var rerr redis.Error
	switch {
	case errors.Is(err, redis.Nil):
		// Retried or deleted by someone else since we read it.
		res.Missing = append(res.Missing, m.ID)
	case errors.As(err, &rerr):
		res.Failed = append(res.Failed, Failure{ID: m.ID, Err: err})
	case err != nil:
		return fmt.Errorf("retry dead letter %s: %w", m.ID, err)
	default:
		res.Retried = append(res.Retried, Retried{ID: m.ID, Stream: source, NewID: newID})
	}
	return nil
}

// ListPartitions is List over the dead-letter streams of consumers whose
// state is split into partitions (fraud.Keys.Each; 0 or 1: one stream):
// up to count dead letters, oldest first across the streams, and the number
// in all.
func ListPartitions(ctx context.Context, rdb redis.Cmdable, keyPrefix string, partitions, count int) ([]DeadLetter, int64, error) {
	letters := []DeadLetter{} // an empty list encodes as [], not null
	var total int64
	for _, k := range (fraud.Keys{Prefix: keyPrefix, Partitions: partitions}).Each() {
		ls, n, err := List(ctx, rdb, k.Prefix, count)
		if err != nil {
			return nil, 0, err
		}
		letters, total = append(letters, ls...), total+n
	}
	// Entry ids are times: oldest first across the streams.
	slices.SortStableFunc(letters, func(a, b DeadLetter) int { return CompareEntryIDs(a.ID, b.ID) })
	return letters[:min(len(letters), count)], total, nil
}

// RetryPartitions is Retry (or RetryAll, when all is set) over the
// dead-letter streams of consumers whose state is split into partitions: an
// id is looked up in each partition's stream, and is Missing only when none
// holds it; stream is the source stream's base name, each partition's being
// partition.Stream(stream, p, partitions).
func RetryPartitions(ctx context.Context, rdb redis.Cmdable, keyPrefix string, partitions int, ids []string, all bool, stream string) (RetryResult, error) {
	var res RetryResult
	missing := map[string]int{} // how many partitions do not hold each id
	n := max(partitions, 1)
	var err error
	for p, k := range (fraud.Keys{Prefix: keyPrefix, Partitions: partitions}).Each() {
		var r RetryResult
		source := partition.Stream(stream, p, partitions)
		if all {
			r, err = RetryAll(ctx, rdb, k.Prefix, source)
		} else {
			r, err = Retry(ctx, rdb, k.Prefix, ids, source)
		}
		res.Retried, res.Failed = append(res.Retried, r.Retried...), append(res.Failed, r.Failed...)
		for _, id := range r.Missing {
			missing[id]++
		}
		if err != nil {
			break
		}
	}
	for _, id := range ids {
		if missing[id] == n && !slices.Contains(res.Missing, id) {
			res.Missing = append(res.Missing, id)
		}
	}
	return res, err
}

// CompareEntryIDs orders two stream entry ids (ms-seq) by time.
func CompareEntryIDs(a, b string) int {
	am, as, _ := strings.Cut(a, "-")
	bm, bs, _ := strings.Cut(b, "-")
	num := func(s string) uint64 { n, _ := strconv.ParseUint(s, 10, 64); return n }
	return cmp.Or(cmp.Compare(num(am), num(bm)), cmp.Compare(num(as), num(bs)))
}
