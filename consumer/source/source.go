// Package source is the seam between a consumer and the broker it reads
// from: Redis Streams' is the consumer's own (consumer.New), NATS
// JetStream's is package consumer/natssource (consumer.NewWithSource), and
// package consumer/source/sourcetest is the kit a Source of one's own
// passes.
//
// The consumer keeps everything but the messages in Redis, whatever the
// source: the partition leases and their fences, its name's lease, dead
// letters and stats. For each partition it comes to own it opens the
// partition on the Source, reads, applies each message's effect through its
// handler, and settles each message: acknowledged, negatively acknowledged
// for a retry after a delay, or terminated once dead-lettered. A new owner
// meets what was not acknowledged first, in order, so a partition's order
// holds across failures and owners; after a failure, a reader that can no
// longer go on in order (Valid) is opened again.
package source

import (
	"context"
	"errors"
	"time"
)

// ErrFenced: the partition has a newer owner (consumer.ErrFenced is this
// error).
var ErrFenced = errors.New("partition lease lost")

// Source is a broker a consumer reads its partitions from.
type Source interface {
	// System names the broker: the spans' messaging.system and the dead
	// letters' dlq_broker ("nats").
	System() string
	// Ping checks that the broker answers (consumer.Ready).
	Ping(ctx context.Context) error
	// CheckRetention reports why dedupe records kept for ttl cannot cover
	// the messages of subject read again from the first one (the broker
	// keeps them longer, or forever). checked is false when it cannot tell
	// yet (no stream yet): the consumer asks again at the next Open.
	CheckRetention(ctx context.Context, subject string, ttl time.Duration) (checked bool, err error)
	// Open takes the partition over for its owner: whatever an earlier
	// owner received and did not acknowledge comes first, in order, and
	// what an earlier owner still reading gets comes to the new owner too,
	// before anything newer (JetStream's gives the earlier owner nothing
	// more; Redis Streams' adopts what it read). It may fail with an error
	// wrapping ErrFenced when a newer owner (a greater Epoch) has opened it.
	Open(ctx context.Context, p Partition) (Reader, error)
	// Backlog reports the group's messages of the partition delivered and
	// not acknowledged (pending), and not delivered yet (lag, negative when
	// the broker cannot tell); found is false when the partition has not
	// been opened yet (consumer.GroupCollector).
	Backlog(ctx context.Context, group, subject string, partition int) (pending, lag int64, found bool, err error)
}

// Partition is what a consumer opens on a Source.
type Partition struct {
	Group   string
	Subject string // the partition's stream name (the relay's destination)
	N       int    // the partition's number
	// Epoch is the owner's lease epoch: each new owner's is greater.
	Epoch int64
	Owner string // the owner's lease value, for the broker's records
	// AckWait is how long a message delivered and not settled waits
	// before it is delivered again (consumer.Config.ClaimMinIdle).
	AckWait time.Duration
	// MaxAckPending bounds the messages delivered and not settled.
	MaxAckPending int
}

// Reader reads one partition for its owner.
type Reader interface {
	// Read returns up to n messages (a reader that sizes its reads itself
	// under a backlog, as Redis Streams', may return more): those waiting
	// now or, when none is, the first to arrive within block with those
	// that came with it. No message is not an error.
	Read(ctx context.Context, n int, block time.Duration) ([]Message, error)
	// Valid reports whether the reader still reads the partition in order;
	// false (its connection was replaced: messages sent into the lost one
	// would come after newer ones) makes the consumer open it again.
	Valid() bool
	// Flush makes sure the settlements so far have left, within timeout.
	Flush(timeout time.Duration) error
	// Failed is told the error of a read, or of its messages' effects,
	// before the partition is opened again (a silent connection: the
	// reader may replace it).
	Failed(err error)
}

// Message is one message read from a Source.
type Message interface {
	// Values are the stream entry's fields as the relay wrote them
	// (package relay/entry).
	Values() map[string]any
	ID() string // the broker's id of it (a stream sequence)
	Subject() string
	Deliveries() int64 // how many times it was delivered, this time included
	Ack() error
	// Nak asks for the message again after delay, or when the partition
	// is opened again.
	Nak(delay time.Duration) error
	// Term settles a message that is never to come again (dead-lettered).
	Term() error
}
