package status

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/admin"
	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/consumer/natssource"
	"github.com/tedbank/outbox/internal/connect"
	"github.com/tedbank/outbox/internal/queries"
	"github.com/tedbank/outbox/partition"
)

// Options says what to read.
type Options struct {
	// Aggregate limits the outbox figures and rows to one aggregate type
	// ("": every type).
	Aggregate string
	// Stream is the stream's base name (partition.Stream makes each
	// partition's), Group the consumer group, KeyPrefix its consumers' key
	// prefix, Partitions the stream's partitions (0 or 1: one).
	Stream     string
	Group      string
	KeyPrefix  string
	Partitions int
	// Broker is "redis" or "nats".
	Broker string
	// Samples is how many retrying and dead rows to list (0: none).
	Samples int
	// Light reads what costs the backlog, not the table, for a caller that
	// reads often (the console): the published rows are not counted
	// (Status.PublishedCounted false), and each slot's backlog is counted
	// among the oldest LightSlotRows unpublished rows only
	// (Status.RelayPartitionsCappedAt says when there were more).
	Light bool
	// LightSlotRows, when not 0, replaces the package's LightSlotRows for
	// this read (tests).
	LightSlotRows int64
}

// LightSlotRows bounds the rows whose slot Options.Light counts.
const LightSlotRows = 50_000

// New returns the Status for opts, nothing read yet.
func New(opts Options) *Status {
	n := max(opts.Partitions, 1)
	st := &Status{
		Aggregate: opts.Aggregate, Stream: opts.Stream, Group: opts.Group, KeyPrefix: opts.KeyPrefix,
		DeadLetterStream: consumer.Keys{Prefix: opts.KeyPrefix}.DeadLetters(),
		Partitions:       opts.Partitions, Broker: opts.Broker,
		Streams: partition.Streams(opts.Stream, opts.Partitions),
		Relays:  []Relay{}, RelayPartitions: []RelayPartition{},
		RetryingEvents: []RetryingEvent{}, DeadEvents: []admin.DeadEvent{}, Members: []Member{},
		ByPartition: make([]Partition, n),
		samples:     max(opts.Samples, 0),
		light:       opts.Light,
		slotRows:    cmp.Or(opts.LightSlotRows, LightSlotRows),
	}
	for p := range st.ByPartition {
		st.ByPartition[p] = Partition{Partition: p, Stream: partition.Stream(opts.Stream, p, opts.Partitions)}
	}
	return st
}

// ReadPostgres reads the outbox table, the relays and their slots.
func (st *Status) ReadPostgres(ctx context.Context, pool *pgxpool.Pool) error {
	samples := st.samples
	if samples == 0 {
		samples = 1 // the queries' LIMIT wants a row; the lists are emptied below
		defer func() { st.RetryingEvents, st.DeadEvents = st.RetryingEvents[:0], st.DeadEvents[:0] }()
	}
	q, slotRows := queries.Status(st.Aggregate), int64(math.MaxInt64)
	if st.light {
		q, slotRows = queries.StatusLight(st.Aggregate), st.slotRows
	}
	var published *int64
	err := pool.QueryRow(ctx, q.SQL, q.Args...).
		Scan(&st.Pending, &st.Publishing, &published, &st.Dead, &st.OldestPendingSeconds, &st.Retrying)
	if err != nil {
		return fmt.Errorf("read outbox status: %w", err)
	}
	st.Published, st.PublishedCounted = 0, published != nil
	if published != nil {
		st.Published = *published
	}
	q = queries.StatusListeningRelays()
	if err := pool.QueryRow(ctx, q.SQL, q.Args...).Scan(&st.ListeningRelays); err != nil {
		return fmt.Errorf("count listening relays: %w", err)
	}
	q = queries.StatusRelays()
	rows, err := pool.Query(ctx, q.SQL, q.Args...)
	if err != nil {
		return fmt.Errorf("read the relays: %w", err)
	}
	var r Relay
	_, err = pgx.ForEachRow(rows, []any{&r.Name, &r.PID, &r.Alive, &r.Ownership, &r.Slots, &r.LeaseSecondsLeft, &r.Claimed}, func() error {
		st.Relays = append(st.Relays, r)
		if r.Alive {
			st.LiveRelays++
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("read the relays: %w", err)
	}
	q = queries.StatusRelayPartitions(slotRows)
	rows, err = pool.Query(ctx, q.SQL, q.Args...)
	if err != nil {
		return fmt.Errorf("read the relays' partition slots: %w", err)
	}
	var s RelayPartition
	var owner *string
	var counted int64 // the rows the slots' backlogs counted
	_, err = pgx.ForEachRow(rows, []any{&s.Slot, &owner, &s.Alive, &s.LeaseSecondsLeft, &s.Waiting, &s.OldestSeconds}, func() error {
		counted += s.Waiting
		s.Owner = ""
		if owner == nil {
			st.RelaySlotsFree++
		} else {
			s.Owner = *owner
			if st.RelaySlots == nil {
				st.RelaySlots = map[string]int{}
			}
			st.RelaySlots[s.Owner]++
		}
		st.RelayPartitions = append(st.RelayPartitions, s)
		return nil
	})
	if err != nil {
		return fmt.Errorf("read the relays' partition slots: %w", err)
	}
	if counted >= slotRows {
		// Every unpublished row is in one slot: the count stopped there.
		st.RelayPartitionsCappedAt = slotRows
	}
	q = queries.StatusRetrying(st.Aggregate, int64(samples))
	rows, err = pool.Query(ctx, q.SQL, q.Args...)
	if err != nil {
		return fmt.Errorf("read the retrying rows: %w", err)
	}
	var e RetryingEvent
	var total int64
	_, err = pgx.ForEachRow(rows, []any{&e.EventID, &e.AggregateType, &e.AggregateID, &e.EventType, &e.Status,
		&e.Attempts, &e.LastError, &e.NextAttemptInSeconds, &total}, func() error {
		st.RetryingEvents = append(st.RetryingEvents, e)
		return nil
	})
	if err != nil {
		return fmt.Errorf("read the retrying rows: %w", err)
	}
	if st.DeadEvents, _, err = admin.ListDeadOf(ctx, pool, st.Aggregate, samples); err != nil {
		return err
	}
	return nil
}

// ReadRedisStreams reads each partition's stream and consumer group.
func (st *Status) ReadRedisStreams(ctx context.Context, rdb redis.Cmdable) error {
	defer st.sumPartitions()
	for p := range st.ByPartition {
		ps := &st.ByPartition[p]
		var err error
		if ps.StreamLength, err = rdb.XLen(ctx, ps.Stream).Result(); err != nil {
			return fmt.Errorf("read stream length: %w", err)
		}
		groups, err := rdb.XInfoGroups(ctx, ps.Stream).Result()
		if err != nil && !isNoSuchKey(err) {
			return fmt.Errorf("read consumer groups: %w", err)
		}
		for _, g := range groups {
			if g.Name != st.Group {
				continue
			}
			ps.GroupExists, ps.GroupPending, ps.GroupLag = true, g.Pending, g.Lag
			if g.Lag < 0 {
				// Redis cannot tell the lag (entries were deleted or
				// trimmed): count what follows the last delivered entry.
				after, err := rdb.XRangeN(ctx, ps.Stream, "("+g.LastDeliveredID, "+", 10_000).Result()
				if err != nil {
					return fmt.Errorf("read the group's lag: %w", err)
				}
				ps.GroupLag = int64(len(after))
			}
		}
	}
	return nil
}

func isNoSuchKey(err error) bool {
	return err != nil && (redis.HasErrorPrefix(err, "no such key") || errors.Is(err, redis.Nil))
}

// ReadConsumers reads what the group's consumers keep in Redis, whatever
// the broker: its members, each partition's owner and dead letters.
func (st *Status) ReadConsumers(ctx context.Context, rdb redis.Cmdable) error {
	keys := consumer.Keys{Prefix: st.KeyPrefix, Partitions: max(st.Partitions, 1)}
	gs, err := consumer.Inspect(ctx, rdb, keys, st.Group)
	if err != nil {
		return err
	}
	st.LiveMembers = 0
	for _, m := range gs.Members {
		st.Members = append(st.Members, Member{Name: m.Name, Alive: m.Alive})
		if m.Alive {
			st.LiveMembers++
		}
	}
	st.DeadLettered = 0
	for p, k := range keys.Each() {
		ps := &st.ByPartition[p]
		if ps.DeadLettered, err = rdb.XLen(ctx, k.DeadLetters()).Result(); err != nil {
			return fmt.Errorf("read dead-letter stream length: %w", err)
		}
		st.DeadLettered += ps.DeadLettered
		o := gs.Partitions[p]
		ps.Owner, ps.OwnerAlive, ps.LeaseSecondsLeft = o.Owner, o.Alive, o.LeaseLeft.Seconds()
	}
	return nil
}

// ReadJetStream reads each partition's subject in its JetStream stream (its
// messages) and the group's durable consumer of it (acknowledged pending,
// and lag: not yet delivered).
func (st *Status) ReadJetStream(ctx context.Context, js jetstream.JetStream) error {
	defer st.sumPartitions()
	for p := range st.ByPartition {
		ps := &st.ByPartition[p]
		name, err := js.StreamNameBySubject(ctx, ps.Stream)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			continue // no relay has created it yet: no group either
		}
		if err != nil {
			return fmt.Errorf("find the JetStream stream of %s: %w", ps.Stream, err)
		}
		s, err := js.Stream(ctx, name)
		if err != nil {
			return fmt.Errorf("read JetStream stream %s: %w", name, err)
		}
		info, err := s.Info(ctx, jetstream.WithSubjectFilter(ps.Stream))
		if err != nil {
			return fmt.Errorf("read JetStream stream %s: %w", name, err)
		}
		ps.StreamLength = int64(info.State.Subjects[ps.Stream])
		cons, err := natssource.Durable(ctx, js, name, st.Group, p)
		switch {
		case errors.Is(err, jetstream.ErrConsumerNotFound):
		case err != nil:
			return fmt.Errorf("read the group's durable consumer: %w", err)
		default:
			ci := cons.CachedInfo()
			ps.GroupExists, ps.GroupPending, ps.GroupLag = true, int64(ci.NumAckPending), int64(ci.NumPending)
		}
	}
	return nil
}

// sumPartitions sets the stream's and the group's figures to the sums of
// the partitions' (the group exists when it does on every partition).
func (st *Status) sumPartitions() {
	st.StreamLength, st.GroupPending, st.GroupLag, st.GroupExists = 0, 0, 0, true
	for _, ps := range st.ByPartition {
		st.StreamLength += ps.StreamLength
		st.GroupPending += ps.GroupPending
		st.GroupLag += ps.GroupLag
		st.GroupExists = st.GroupExists && ps.GroupExists
	}
}

// Servers are the servers Read reads: each one nil when it could not be
// opened, with the reason in its error.
type Servers struct {
	Postgres    *pgxpool.Pool
	PostgresErr error
	Redis       redis.Cmdable
	RedisErr    error
	// JetStream is read when Options.Broker is "nats".
	JetStream jetstream.JetStream
	NATSErr   error
}

// Read reads every side of s, records why a side could not be read (its
// error, secrets redacted), judges (Judge) and returns the Status with the
// sides' errors joined.
func Read(ctx context.Context, opts Options, s Servers) (*Status, error) {
	st := New(opts)
	pgErr := s.PostgresErr
	if s.Postgres != nil {
		if pgErr = st.ReadPostgres(ctx, s.Postgres); pgErr != nil {
			st.PostgresReadFailed = true
		}
	}
	redisErr := s.RedisErr
	if s.Redis != nil {
		redisErr = func() error {
			if opts.Broker != "nats" {
				if err := st.ReadRedisStreams(ctx, s.Redis); err != nil {
					return err
				}
			}
			return st.ReadConsumers(ctx, s.Redis)
		}()
	}
	var natsErr error
	if opts.Broker == "nats" {
		natsErr = s.NATSErr
		if s.JetStream != nil {
			natsErr = st.ReadJetStream(ctx, s.JetStream)
		}
	}
	st.PostgresError, st.RedisError, st.NATSError = errLine(pgErr), errLine(redisErr), errLine(natsErr)
	st.Judge()
	return st, errors.Join(pgErr, redisErr, natsErr)
}

// errLine is err on one line, without the secrets a server URL in it may
// carry ("" for nil).
func errLine(err error) string {
	if err == nil {
		return ""
	}
	return connect.RedactSecrets(strings.Join(strings.Fields(err.Error()), " "))
}
