// Package natssource reads a consumer's partitions from NATS JetStream
// (consumer.NewWithSource(rdb, natssource.New(js), h, cfg)). The relay
// (relay/natsbroker) publishes each event to the subject its Redis stream
// would be named, the entry's fields as headers. Each partition is read
// through a durable pull consumer with explicit acknowledgements, by the
// partition's owner only; partition ownership, the consumer's name, dead
// letters and stats stay in Redis exactly as with Redis Streams.
//
// Only services that read from NATS import this package: consumer links no
// NATS client.
package natssource

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/tedbank/outbox/consumer/source"
	"github.com/tedbank/outbox/internal/natsjs"
	"github.com/tedbank/outbox/relay/entry"
)

// Source reads partitions from JetStream.
type Source struct {
	js jetstream.JetStream
}

var _ source.Source = (*Source)(nil)

// New returns a source reading through js. It panics if js is nil (a
// programming error, as http.Handle's nil handler).
func New(js jetstream.JetStream) *Source {
	if js == nil {
		panic("natssource: no JetStream context")
	}
	return &Source{js: js}
}

// System is "nats".
func (*Source) System() string { return "nats" }

// Ping checks that the JetStream account answers.
func (s *Source) Ping(ctx context.Context) error {
	_, err := s.js.AccountInfo(ctx)
	return err
}

// DurableName is the base name of the JetStream durable consumers through
// which group reads partition p: the group's name (its dots, which a
// consumer name cannot have, as underscores) and "_p<p>". Each owner of the
// partition reads through a durable of its own, the base name and
// "_e<lease epoch>" (DurableNameOf): a partition's new owner creates its
// durable from the previous one's ack floor and deletes the older ones, so
// an owner that lost its lease and has not noticed yet fetches nothing of
// the new owner's (with one durable name for all, it fetched from the
// re-created durable, and what it fetched waited out its ack wait while the
// new owner applied the messages after it). Durable finds the current one.
func DurableName(group string, p int) string {
	return strings.NewReplacer(".", "_", "*", "_", ">", "_").Replace(group) + "_p" + strconv.Itoa(p)
}

// DurableNameOf is the name of the durable through which the owner of
// partition p of group with lease epoch epoch reads it.
func DurableNameOf(group string, p int, epoch int64) string {
	return DurableName(group, p) + "_e" + strconv.FormatInt(epoch, 10)
}

// durables lists partition p's durables of group on stream, by name, with
// the epoch of the owner each belongs to (0: the base name, from before
// owners had durables of their own).
func durables(ctx context.Context, js jetstream.JetStream, stream, group string, p int) (map[string]int64, error) {
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, fmt.Errorf("read JetStream stream %s: %w", stream, err)
	}
	base := DurableName(group, p)
	found := map[string]int64{}
	names := s.ConsumerNames(ctx)
	for name := range names.Name() {
		if name == base {
			found[name] = 0
			continue
		}
		rest, ok := strings.CutPrefix(name, base+"_e")
		if !ok {
			continue
		}
		if e, err := strconv.ParseInt(rest, 10, 64); err == nil && e > 0 {
			found[name] = e
		}
	}
	if err := names.Err(); err != nil {
		return nil, fmt.Errorf("list the durable consumers of %s: %w", stream, err)
	}
	return found, nil
}

// Durable returns the durable consumer through which group reads
// partition p on stream now: its current owner's (the greatest epoch). The
// error wraps jetstream.ErrConsumerNotFound when the partition has none yet.
func Durable(ctx context.Context, js jetstream.JetStream, stream, group string, p int) (jetstream.Consumer, error) {
	ds, err := durables(ctx, js, stream, group, p)
	if err != nil {
		return nil, err
	}
	newest, epoch := "", int64(-1)
	for name, e := range ds {
		if e > epoch {
			newest, epoch = name, e
		}
	}
	if newest == "" {
		return nil, fmt.Errorf("partition %d of group %s on %s: %w", p, group, stream, jetstream.ErrConsumerNotFound)
	}
	return js.Consumer(ctx, stream, newest)
}

// openTimeout bounds Open's requests: one the server never answers (sent as
// the connection dropped, or to a server restarting) fails then and Open is
// tried again, instead of waiting for JetStream's default 5 s (a consumer
// came back 4 s after a nats-server restart in the chaos suite, docs/log.md).
const openTimeout = 2 * time.Second

// Open creates the durable consumer of p's owner (its lease epoch's) from
// the ack floor of the newest durable before it, and deletes the older ones,
// so that what an earlier owner received and did not acknowledge comes
// first, in stream order, and an earlier owner still fetching reads nothing
// more. A durable of a greater epoch (a newer owner's) fences it.
func (s *Source) Open(ctx context.Context, p source.Partition) (_ source.Reader, err error) {
	defer s.reconnectIfStale(&err)
	ctx, cancel := context.WithTimeout(ctx, openTimeout)
	defer cancel()
	reconnects := s.js.Conn().Stats().Reconnects
	stream, err := s.js.StreamNameBySubject(ctx, p.Subject)
	if err != nil {
		return nil, fmt.Errorf("find the JetStream stream of subject %s (the relay creates it when it starts): %w", p.Subject, err)
	}
	ds, err := durables(ctx, s.js, stream, p.Group, p.N)
	if err != nil {
		return nil, err
	}
	name := DurableNameOf(p.Group, p.N, p.Epoch)
	cc := jetstream.ConsumerConfig{
		Durable: name, Description: "outbox consumer group " + p.Group + ", partition " + strconv.Itoa(p.N) + ", owner " + p.Owner,
		FilterSubject: p.Subject, AckPolicy: jetstream.AckExplicitPolicy, AckWait: p.AckWait,
		MaxAckPending: p.MaxAckPending, DeliverPolicy: jetstream.DeliverAllPolicy,
	}
	newest := int64(-1)
	for old, e := range ds {
		if e > p.Epoch {
			return nil, fmt.Errorf("%w: partition %d has a newer owner's durable %s", source.ErrFenced, p.N, old)
		}
		info, err := s.js.Consumer(ctx, stream, old)
		if errors.Is(err, jetstream.ErrConsumerNotFound) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("read the durable consumer %s: %w", old, err)
		}
		if floor := info.CachedInfo().AckFloor.Stream; e > newest && floor > 0 {
			cc.DeliverPolicy, cc.OptStartSeq = jetstream.DeliverByStartSequencePolicy, floor+1
		} else if e > newest {
			cc.DeliverPolicy, cc.OptStartSeq = jetstream.DeliverAllPolicy, 0
		}
		newest = max(newest, e)
	}
	for old := range ds {
		if err := s.js.DeleteConsumer(ctx, stream, old); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
			return nil, fmt.Errorf("delete the earlier durable consumer %s: %w", old, err)
		}
	}
	cons, err := s.js.CreateOrUpdateConsumer(ctx, stream, cc)
	if err != nil {
		return nil, fmt.Errorf("create the durable consumer %s on %s: %w", name, stream, err)
	}
	return &reader{js: s.js, cons: cons, reconnects: reconnects, name: name, from: max(cc.OptStartSeq, 1)}, nil
}

// CheckRetention reports why dedupe records kept ttl cannot cover a
// partition read again from the stream's first message (its durables gone:
// deleted by hand, or never created): they must outlive the stream's
// messages (its MaxAge, --nats-max-age).
func (s *Source) CheckRetention(ctx context.Context, subject string, ttl time.Duration) (_ bool, err error) {
	defer s.reconnectIfStale(&err)
	name, err := s.js.StreamNameBySubject(ctx, subject)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return false, nil // the relay has not created it yet
	}
	if err != nil {
		return false, fmt.Errorf("find the JetStream stream of subject %s: %w", subject, err)
	}
	st, err := s.js.Stream(ctx, name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return false, nil // deleted since: checked once the relay creates it again
	}
	if err != nil {
		return false, fmt.Errorf("read JetStream stream %s: %w", name, err)
	}
	switch age := st.CachedInfo().Config.MaxAge; {
	case age == 0:
		return true, fmt.Errorf("JetStream stream %s keeps messages forever, but dedupe records are kept %s: "+
			"a partition read again from its first message would apply older effects twice; give the stream a max age "+
			"(relay --nats-max-age) no longer than the records", name, ttl)
	case ttl < age:
		return true, fmt.Errorf("JetStream stream %s keeps messages %s, longer than the dedupe records (%s): "+
			"a partition read again from its first message would apply older effects twice; keep the records at least as long",
			name, age, ttl)
	}
	return true, nil
}

// Backlog reads the partition's current durable: its messages delivered and
// not acknowledged, and those not delivered yet.
func (s *Source) Backlog(ctx context.Context, group, subject string, p int) (pending, lag int64, found bool, err error) {
	stream, err := s.js.StreamNameBySubject(ctx, subject)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return 0, 0, false, nil
	}
	if err != nil {
		return 0, 0, false, err
	}
	cons, err := Durable(ctx, s.js, stream, group, p)
	if errors.Is(err, jetstream.ErrConsumerNotFound) {
		return 0, 0, false, nil
	}
	if err != nil {
		return 0, 0, false, err
	}
	info := cons.CachedInfo()
	return int64(info.NumAckPending), int64(info.NumPending), true, nil
}

// reconnectIfStale replaces the connection when *err says it went silent
// (a request timed out): the partition's next open runs on a new one
// instead of timing out again until the client's pings notice.
func (s *Source) reconnectIfStale(err *error) {
	if *err != nil && natsjs.Stale(*err) {
		_ = s.js.Conn().ForceReconnect()
	}
}

// reader reads one partition through its owner's durable.
type reader struct {
	js         jetstream.JetStream
	cons       jetstream.Consumer
	reconnects uint64 // the connection's reconnects when the partition was opened
	name       string
	from       uint64
	// delivered is the consumer sequence of the last message this reader
	// received (0: none yet; the durable is new with each reader). The
	// server numbers every delivery of the durable, redeliveries too, and
	// only this reader fetches from it: a gap is a delivery that never
	// reached it.
	delivered uint64
}

// String names the durable and where it starts, for the consumer's log.
func (r *reader) String() string {
	return "durable " + r.name + " from sequence " + strconv.FormatUint(r.from, 10)
}

// Valid: messages the server sent into a lost connection wait out their ack
// wait before they come again, and newer ones would overtake them: after a
// reconnect the partition is opened again, from its ack floor, as after a
// crash.
func (r *reader) Valid() bool { return r.js.Conn().Stats().Reconnects == r.reconnects }

// Failed replaces a connection that went silent (half-open?) for the retry.
func (r *reader) Failed(err error) {
	if natsjs.Stale(err) {
		_ = r.js.Conn().ForceReconnect()
	}
}

// Flush makes sure the acknowledgements, fire-and-forget, left (a process
// stopping right after would lose them, and the messages would come again,
// as duplicates).
func (r *reader) Flush(timeout time.Duration) error {
	if err := r.js.Conn().FlushTimeout(timeout); err != nil {
		return fmt.Errorf("flush the acknowledgements: %w", err)
	}
	return nil
}

// Read returns the messages waiting now, or, when none is, the first to
// arrive within block with those that came with it. (A Fetch of a whole
// batch would wait out the block whenever fewer are waiting: every event's
// latency would include it.)
func (r *reader) Read(ctx context.Context, n int, block time.Duration) ([]source.Message, error) {
	limit := block + fetchGrace
	msgs, err := r.inOrder(collect(ctx, limit, r.replaced)(r.cons.FetchNoWait(n)))
	if err == nil && len(msgs) == 0 {
		started := time.Now()
		if msgs, err = r.inOrder(collect(ctx, limit, r.replaced)(r.cons.Fetch(1, jetstream.FetchMaxWait(block)))); err == nil && len(msgs) == 1 && n > 1 {
			var more []source.Message
			more, err = r.inOrder(collect(ctx, limit, r.replaced)(r.cons.FetchNoWait(n - 1)))
			msgs = append(msgs, more...)
		}
		if err == nil && len(msgs) == 0 && time.Since(started) >= block*3/2 && ctx.Err() == nil {
			// The server ends an expired pull request at its expiry; only
			// the client's own timer, later, ended this one: the
			// connection is silent (half-open).
			err = errSilent
		}
	}
	return msgs, err
}

// errDeliveryLost: the server delivered messages that never reached the
// reader (sent into a connection since replaced, or after the client gave
// a fetch up); those after them must wait for a new reader, which starts at
// the ack floor.
var errDeliveryLost = errors.New("messages delivered by the server never reached this reader; reading the partition again from its ack floor")

// inOrder keeps of msgs those that follow, delivery after delivery, what
// this reader received before: at a gap it returns the ones before it and
// errDeliveryLost.
func (r *reader) inOrder(msgs []source.Message, err error) ([]source.Message, error) {
	for i, m := range msgs {
		seq := m.(*message).consumerSeq
		if seq != r.delivered+1 {
			return msgs[:i], fmt.Errorf("%w (delivery %d after %d)", errDeliveryLost, seq, r.delivered)
		}
		r.delivered = seq
	}
	return msgs, err
}

// fetchGrace is how much longer than its own wait a fetch may take before
// it is given up (its connection went silent, and the client library did
// not notice).
const fetchGrace = 5 * time.Second

// replacedEvery is how often a fetch looks whether its connection was
// replaced (a reconnection: the client reconnects every 250 ms, natsjs).
const replacedEvery = 50 * time.Millisecond

// replaced reports whether the connection was replaced since the reader
// opened (Valid's opposite).
func (r *reader) replaced() bool { return !r.Valid() }

// errSilent: a fetch ended by the client's timer, not the server's answer.
var errSilent = fmt.Errorf("no answer from the server to a pull request (half-open connection?): %w", nats.ErrTimeout)

// errFetchHung: a fetch did not end within its wait and fetchGrace.
var errFetchHung = fmt.Errorf("fetch did not end in time: %w", nats.ErrTimeout)

// collect returns a function that reads a fetch's messages, giving up after
// limit; running out of time or of messages is not an error. Messages that
// arrive after it gave up are delivered again after their ack wait.
func collect(ctx context.Context, limit time.Duration, replaced func() bool) func(jetstream.MessageBatch, error) ([]source.Message, error) {
	return func(batch jetstream.MessageBatch, err error) ([]source.Message, error) {
		if err != nil {
			return nil, fmt.Errorf("fetch: %w", err)
		}
		timer := time.NewTimer(limit)
		defer timer.Stop()
		look := time.NewTicker(replacedEvery)
		defer look.Stop()
		var msgs []source.Message
		for {
			select {
			case m, ok := <-batch.Messages():
				if ok {
					msgs = append(msgs, newMessage(m))
					continue
				}
			case <-timer.C:
				return msgs, errFetchHung
			case <-ctx.Done():
				return msgs, ctx.Err()
			case <-look.C:
				if replaced() {
					// The pull request went with the connection (a server
					// restarted): nothing would end it before its own
					// timer. The reader is no longer Valid: the partition
					// is opened again on the new connection.
					return msgs, nil
				}
				continue
			}
			break
		}
		if err := batch.Error(); err != nil && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, nats.ErrTimeout) &&
			!errors.Is(err, jetstream.ErrNoMessages) {
			return msgs, fmt.Errorf("fetch: %w", err)
		}
		return msgs, nil
	}
}

// message is a JetStream message with the entry's fields read from its
// headers and its body.
type message struct {
	jetstream.Msg
	values      map[string]any
	id          string
	deliveries  int64
	consumerSeq uint64
}

func newMessage(m jetstream.Msg) *message {
	values := map[string]any{entry.Payload: string(m.Data())}
	for k, v := range m.Headers() {
		if len(v) > 0 {
			values[k] = v[0]
		}
	}
	msg := &message{Msg: m, values: values, deliveries: 1}
	if meta, err := m.Metadata(); err == nil {
		msg.id = strconv.FormatUint(meta.Sequence.Stream, 10)
		msg.deliveries = int64(meta.NumDelivered)
		msg.consumerSeq = meta.Sequence.Consumer
	}
	return msg
}

func (m *message) Values() map[string]any        { return m.values }
func (m *message) ID() string                    { return m.id }
func (m *message) Deliveries() int64             { return m.deliveries }
func (m *message) Nak(delay time.Duration) error { return m.NakWithDelay(delay) }
