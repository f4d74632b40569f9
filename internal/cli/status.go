package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/consumer/natssource"
	"io"
	"maps"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/connect"
	"github.com/tedbank/outbox/internal/queries"
	"github.com/tedbank/outbox/partition"
)

// Status is what 'outbox status --json' prints. During an outage it still
// shows what the reachable server says: the other side's figures are zero and
// its error is in postgres_error or redis_error (and the command exits 1).
type Status struct {
	Pending              int64   `json:"pending"`
	Publishing           int64   `json:"publishing"`
	Published            int64   `json:"published"`
	Dead                 int64   `json:"dead"`
	OldestPendingSeconds float64 `json:"oldest_pending_seconds"`
	ListeningRelays      int64   `json:"listening_relays"`
	Stream               string  `json:"stream"`
	StreamLength         int64   `json:"stream_length"`
	Group                string  `json:"group"`
	GroupPending         int64   `json:"group_pending"`
	GroupLag             int64   `json:"group_lag"`
	GroupExists          bool    `json:"group_exists"`
	DeadLetterStream     string  `json:"dead_letter_stream"`
	DeadLettered         int64   `json:"dead_lettered"`
	// With several partitions, the stream, group and dead-letter figures
	// above are sums over the partitions, and ByPartition has each one.
	Partitions int `json:"partitions"`
	// Streams is every partition's stream (or JetStream subject) name, by
	// partition: what the relay writes (docs/streams.md).
	Streams     []string          `json:"streams"`
	ByPartition []PartitionStatus `json:"by_partition"`
	// RelaySlots: with relays that own partitions (--ownership
	// partitions), how many of the partition slots each relay holds;
	// RelaySlotsFree: how many nobody holds (empty and 0 with row claims:
	// no slot is ever held).
	RelaySlots     map[string]int `json:"relay_slots,omitempty"`
	RelaySlotsFree int            `json:"relay_slots_free"`
	// Broker is where the events travel (--broker): "redis", or "nats",
	// where the stream, group and lag figures are the JetStream stream's
	// messages on the subject and the group's durable consumers'.
	Broker string `json:"broker"`
	// PostgresError, RedisError and NATSError say why a side could not be
	// read (empty: it was read).
	PostgresError string `json:"postgres_error,omitempty"`
	RedisError    string `json:"redis_error,omitempty"`
	NATSError     string `json:"nats_error,omitempty"`
	// pgNotMigrated: PostgreSQL answered, without the outbox's tables.
	pgNotMigrated bool
}

// PartitionStatus is one partition's stream and group, and which consumer
// of the group holds it.
type PartitionStatus struct {
	Partition    int    `json:"partition"`
	Stream       string `json:"stream"`
	StreamLength int64  `json:"stream_length"`
	GroupPending int64  `json:"group_pending"`
	GroupLag     int64  `json:"group_lag"`
	GroupExists  bool   `json:"group_exists"`
	Owner        string `json:"owner"` // the consumer holding its lease; empty: none
	DeadLettered int64  `json:"dead_lettered"`
}

func runStatus(ctx context.Context, e *env, args []string) error {
	var c common
	fs := e.flags("status", &c)
	stream := fs.String("stream", fraud.DefaultStream, "stream to report on")
	group := fs.String("group", fraud.DefaultGroup, "consumer group to report on")
	keyPrefix := fs.String("key-prefix", fraud.DefaultKeyPrefix, "anti-fraud key prefix (for its dead-letter stream)")
	partitions := partitionsFlag(e, fs, "the partitions of the stream (figures are summed over them, and shown for each)")
	asJSON := fs.Bool("json", false, "print JSON")
	broker := brokerFlags(e, fs)
	if err := e.parse(fs, args); err != nil {
		return err
	}
	if err := broker.check(); err != nil {
		return err
	}
	nParts, err := partitions()
	if err != nil {
		return err
	}
	if err := (fraud.Config{Config: consumer.Config{Stream: *stream, Group: *group, KeyPrefix: *keyPrefix, Consumer: "status"}}).Validate(); err != nil {
		return usagef("%v", err)
	}
	if _, err := c.logger(e.stderr); err != nil {
		return err
	}
	st := Status{Stream: *stream, Group: *group, DeadLetterStream: fraud.Keys{Prefix: *keyPrefix}.DeadLetters(), Partitions: nParts,
		Broker: broker.name}
	st.Streams = partition.Streams(*stream, nParts)
	keys := fraud.Keys{Prefix: *keyPrefix, Partitions: nParts}
	// Each side is read on its own: an operator needs the PostgreSQL backlog
	// most when Redis is down, and the stream's state when PostgreSQL is.
	pgErr := func() error {
		pool, err := openOutbox(ctx, c.databaseURL, connect.PostgresOptions{AppName: "outbox-status", MaxConns: 2})
		if err != nil {
			return err
		}
		defer pool.Close()
		return readOutboxStatus(ctx, pool, &st)
	}()
	redisErr := func() error {
		rdb, err := c.redis(ctx, connect.RedisOptions{ClientName: "outbox-status"})
		if err != nil {
			return err
		}
		defer rdb.Close()
		if broker.nats() {
			return readConsumerState(ctx, rdb, keys, &st)
		}
		return readStreamStatus(ctx, rdb, keys, &st)
	}()
	var natsErr error
	if broker.nats() {
		natsErr = func() error {
			nc, js, err := broker.connect("outbox-status")
			if err != nil {
				return err
			}
			defer nc.Close()
			return readJetStreamStatus(ctx, js, &st)
		}()
	}
	if pgErr != nil {
		st.PostgresError = connect.RedactSecrets(oneLine(pgErr))
		st.pgNotMigrated = errors.Is(pgErr, errNotMigrated)
	}
	if redisErr != nil {
		st.RedisError = connect.RedactSecrets(oneLine(redisErr))
	}
	if natsErr != nil {
		st.NATSError = connect.RedactSecrets(oneLine(natsErr))
	}
	if *asJSON {
		if err := json.NewEncoder(e.stdout).Encode(st); err != nil {
			return err
		}
	} else {
		printStatus(e.stdout, st)
	}
	return errors.Join(pgErr, redisErr, natsErr)
}

func printStatus(w io.Writer, st Status) {
	switch {
	case st.pgNotMigrated:
		fmt.Fprintf(w, "outbox   PostgreSQL not migrated: %s\n", st.PostgresError)
	case st.PostgresError != "":
		fmt.Fprintf(w, "outbox   PostgreSQL unreachable: %s\n", st.PostgresError)
	default:
		fmt.Fprintf(w, "outbox   pending %d  publishing %d  published %d  dead %d  oldest pending %.1fs  relays listening %d\n",
			st.Pending, st.Publishing, st.Published, st.Dead, st.OldestPendingSeconds, st.ListeningRelays)
		if len(st.RelaySlots) > 0 {
			var held []string
			for _, owner := range slices.Sorted(maps.Keys(st.RelaySlots)) {
				held = append(held, fmt.Sprintf("%s %d", owner, st.RelaySlots[owner]))
			}
			fmt.Fprintf(w, "relays   partition slots held: %s  free %d\n", strings.Join(held, ", "), st.RelaySlotsFree)
		}
	}
	if st.RedisError != "" {
		fmt.Fprintf(w, "stream   %s  Redis unreachable: %s\n", st.Stream, st.RedisError)
		return
	}
	if st.NATSError != "" {
		fmt.Fprintf(w, "stream   %s  NATS unreachable: %s\n", st.Stream, st.NATSError)
		return
	}
	on := ""
	if st.Broker == brokerNATS {
		on = "  (NATS JetStream subject)"
	}
	fmt.Fprintf(w, "stream   %s  length %d%s\n", st.Stream, st.StreamLength, on)
	if st.GroupExists {
		fmt.Fprintf(w, "group    %s  pending %d  lag %d\n", st.Group, st.GroupPending, st.GroupLag)
	} else {
		fmt.Fprintf(w, "group    %s  not created yet\n", st.Group)
	}
	fmt.Fprintf(w, "dlq      %s  entries %d\n", st.DeadLetterStream, st.DeadLettered)
	if st.Partitions > 1 {
		for _, p := range st.ByPartition {
			owner := p.Owner
			if owner == "" {
				owner = "(none)"
			}
			fmt.Fprintf(w, "  p%-4d  %s  length %d  pending %d  lag %d  dlq %d  owner %s\n",
				p.Partition, p.Stream, p.StreamLength, p.GroupPending, p.GroupLag, p.DeadLettered, owner)
		}
	} else if len(st.ByPartition) == 1 && st.ByPartition[0].Owner != "" {
		fmt.Fprintf(w, "owner    %s\n", st.ByPartition[0].Owner)
	}
}

func readOutboxStatus(ctx context.Context, pool *pgxpool.Pool, st *Status) error {
	q := queries.Status()
	err := pool.QueryRow(ctx, q.SQL, q.Args...).
		Scan(&st.Pending, &st.Publishing, &st.Published, &st.Dead, &st.OldestPendingSeconds)
	if err != nil {
		return fmt.Errorf("read outbox status: %w", err)
	}
	q = queries.StatusListeningRelays()
	if err := pool.QueryRow(ctx, q.SQL, q.Args...).Scan(&st.ListeningRelays); err != nil {
		return fmt.Errorf("count listening relays: %w", err)
	}
	q = queries.StatusRelaySlots()
	rows, err := pool.Query(ctx, q.SQL, q.Args...)
	if err != nil {
		return fmt.Errorf("read relay partition slots: %w", err)
	}
	var owner *string
	var slots int
	_, err = pgx.ForEachRow(rows, []any{&owner, &slots}, func() error {
		if owner == nil {
			st.RelaySlotsFree += slots
			return nil
		}
		if st.RelaySlots == nil {
			st.RelaySlots = map[string]int{}
		}
		st.RelaySlots[*owner] = slots
		return nil
	})
	if err != nil {
		return fmt.Errorf("read relay partition slots: %w", err)
	}
	return nil
}

func readStreamStatus(ctx context.Context, rdb redis.Cmdable, keys fraud.Keys, st *Status) error {
	st.GroupExists = true
	for p, k := range keys.Each() {
		ps := PartitionStatus{Partition: p, Stream: partition.Stream(st.Stream, p, st.Partitions)}
		if err := readPartitionStatus(ctx, rdb, k, st.Group, &ps); err != nil {
			return err
		}
		st.ByPartition = append(st.ByPartition, ps)
		st.StreamLength += ps.StreamLength
		st.GroupPending += ps.GroupPending
		st.GroupLag += ps.GroupLag
		st.GroupExists = st.GroupExists && ps.GroupExists
		st.DeadLettered += ps.DeadLettered
	}
	return nil
}

func readPartitionStatus(ctx context.Context, rdb redis.Cmdable, keys fraud.Keys, group string, ps *PartitionStatus) error {
	if err := readPartitionConsumer(ctx, rdb, keys, group, ps); err != nil {
		return err
	}
	var err error
	if ps.StreamLength, err = rdb.XLen(ctx, ps.Stream).Result(); err != nil {
		return fmt.Errorf("read stream length: %w", err)
	}
	groups, err := rdb.XInfoGroups(ctx, ps.Stream).Result()
	if err != nil && !isNoSuchKey(err) {
		return fmt.Errorf("read consumer groups: %w", err)
	}
	for _, g := range groups {
		if g.Name == group {
			ps.GroupExists, ps.GroupPending, ps.GroupLag = true, g.Pending, g.Lag
		}
	}
	return nil
}

// readPartitionConsumer reads what the consumers keep in Redis of one
// partition, whatever the broker: its dead letters and its owner.
func readPartitionConsumer(ctx context.Context, rdb redis.Cmdable, keys fraud.Keys, group string, ps *PartitionStatus) error {
	var err error
	if ps.DeadLettered, err = rdb.XLen(ctx, keys.DeadLetters()).Result(); err != nil {
		return fmt.Errorf("read dead-letter stream length: %w", err)
	}
	lease, err := rdb.Get(ctx, keys.Lease(group)).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("read the partition's lease: %w", err)
	}
	if _, holder, ok := strings.Cut(lease, "|"); ok {
		ps.Owner, _, _ = strings.Cut(holder, "|")
	}
	return nil
}

func isNoSuchKey(err error) bool {
	return err != nil && (redis.HasErrorPrefix(err, "no such key") || errors.Is(err, redis.Nil))
}

// readConsumerState reads, with NATS as the broker, what the consumers keep
// in Redis: each partition's dead letters and owner.
func readConsumerState(ctx context.Context, rdb redis.Cmdable, keys fraud.Keys, st *Status) error {
	ensurePartitions(st)
	st.DeadLettered = 0
	for p, k := range keys.Each() {
		if err := readPartitionConsumer(ctx, rdb, k, st.Group, &st.ByPartition[p]); err != nil {
			return err
		}
		st.DeadLettered += st.ByPartition[p].DeadLettered
	}
	return nil
}

// readJetStreamStatus reads each partition's subject in its JetStream
// stream (its messages) and the group's durable consumer of it (acknowledged
// pending, and lag: not yet delivered).
func readJetStreamStatus(ctx context.Context, js jetstream.JetStream, st *Status) error {
	ensurePartitions(st)
	st.GroupExists = true
	for p := range st.ByPartition {
		ps := &st.ByPartition[p]
		name, err := js.StreamNameBySubject(ctx, ps.Stream)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			st.GroupExists = false
			continue // no relay has created it yet
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
			st.GroupExists = false
		case err != nil:
			return fmt.Errorf("read the group's durable consumer: %w", err)
		default:
			ci := cons.CachedInfo()
			ps.GroupExists, ps.GroupPending, ps.GroupLag = true, int64(ci.NumAckPending), int64(ci.NumPending)
		}
		st.StreamLength += ps.StreamLength
		st.GroupPending += ps.GroupPending
		st.GroupLag += ps.GroupLag
	}
	return nil
}

// ensurePartitions gives st one PartitionStatus per partition.
func ensurePartitions(st *Status) {
	if len(st.ByPartition) == max(st.Partitions, 1) {
		return
	}
	st.ByPartition = make([]PartitionStatus, max(st.Partitions, 1))
	for p := range st.ByPartition {
		st.ByPartition[p] = PartitionStatus{Partition: p, Stream: partition.Stream(st.Stream, p, st.Partitions)}
	}
}
