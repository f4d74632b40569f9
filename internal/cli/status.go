package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
	"strings"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/connect"
	"github.com/tedbank/outbox/internal/status"
	"github.com/tedbank/outbox/relay"
)

// errNotDelivered: status read the deployment and found it not delivering
// (its problems are printed with the rest).
type errNotDelivered struct{ problems []string }

func (e errNotDelivered) Error() string {
	more := ""
	if n := len(e.problems) - 1; n > 0 {
		more = fmt.Sprintf(" (and %d more %s above)", n, plural(int64(n), "problem", "problems"))
	}
	return "not delivered: " + e.problems[0] + more
}

func runStatus(ctx context.Context, e *env, args []string) error {
	var c common
	fs := e.flags("status", &c)
	broker, options := statusFlags(e, fs)
	asJSON := fs.Bool("json", false, "print JSON (docs/operations.md, \"Is it being delivered?\")")
	light := fs.Bool("light", false, fmt.Sprintf("read what the backlog costs, not the whole outbox table, as the console does: "+
		"the published rows are not counted (published_counted false) and each slot's backlog is counted among the oldest %d unpublished rows; "+
		"for a table that keeps many published rows", status.LightSlotRows))
	if err := e.parse(fs, args); err != nil {
		return err
	}
	opts, err := options()
	if err != nil {
		return err
	}
	opts.Light = *light
	if _, err := c.logger(e.stderr); err != nil {
		return err
	}
	srv, closeAll := openStatusServers(ctx, &c, broker, "outbox-status")
	defer closeAll()
	st, readErr := status.Read(ctx, opts, srv)
	st.PostgresNotMigrated = errors.Is(srv.PostgresErr, errNotMigrated)
	if *asJSON {
		if err := json.NewEncoder(e.stdout).Encode(st); err != nil {
			return err
		}
	} else {
		printStatus(e.stdout, st)
	}
	if readErr != nil {
		return readErr
	}
	if !st.Healthy {
		return errNotDelivered{st.Problems}
	}
	return nil
}

// statusFlags defines the flags that say what status (and the console)
// reads: the event type, its stream, the group and its consumers' keys,
// the partitions and the broker. options checks them after parsing.
func statusFlags(e *env, fs *flag.FlagSet) (broker *brokerChoice, options func() (status.Options, error)) {
	aggregate := fs.String("aggregate", "", "the aggregate type to report on: its stream is <stream-prefix><aggregate>, and the outbox figures are its own; unset, every type's rows and the stream --stream")
	streamPrefix := fs.String("stream-prefix", relay.DefaultStreamPrefix, "the relays' stream key prefix, with --aggregate")
	stream := fs.String("stream", fraud.DefaultStream, "the stream to report on; with --aggregate, <stream-prefix><aggregate> unless given")
	group := fs.String("group", fraud.DefaultGroup, "the consumer group to report on")
	keyPrefix := fs.String("key-prefix", "", "the group's consumers' key prefix: their leases, members and dead letters; unset, <group>: (fraud: for anti-fraud)")
	samples := fs.Int("samples", 5, "how many retrying and dead events to list")
	partitions := partitionsFlag(e, fs, "the partitions of the stream (figures are summed over them, and shown for each)")
	broker = brokerFlags(e, fs)
	return broker, func() (status.Options, error) {
		if err := broker.check(); err != nil {
			return status.Options{}, err
		}
		nParts, err := partitions()
		if err != nil {
			return status.Options{}, err
		}
		if *aggregate != "" && !validAggregateType(*aggregate) {
			return status.Options{}, usagef("--aggregate %q: want an aggregate type as outbox_messages holds them (letters, digits, '_', '.', '-'; at most 100)", *aggregate)
		}
		if *aggregate != "" && !isSet(fs, "stream") {
			*stream = *streamPrefix + *aggregate
		}
		if !isSet(fs, "key-prefix") {
			*keyPrefix = *group + ":"
		}
		if *samples < 0 {
			return status.Options{}, usagef("--samples %d: want 0 or more", *samples)
		}
		if err := (consumer.Config{Name: "status", Stream: *stream, Group: *group, KeyPrefix: *keyPrefix, Consumer: "status"}).Validate(); err != nil {
			return status.Options{}, usagef("%v", err)
		}
		return status.Options{Aggregate: *aggregate, Stream: *stream, Group: *group, KeyPrefix: *keyPrefix,
			Partitions: nParts, Broker: broker.name, Samples: *samples}, nil
	}
}

// validAggregateType is outbox_messages' check on aggregate_type.
func validAggregateType(s string) bool {
	if len(s) == 0 || len(s) > 100 {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_' || r == '.' || r == '-') {
			return false
		}
	}
	return true
}

// openStatusServers opens the servers status reads, each on its own: an
// operator needs the PostgreSQL backlog most when Redis is down, and the
// stream's state when PostgreSQL is. closeAll closes what was opened.
func openStatusServers(ctx context.Context, c *common, broker *brokerChoice, app string) (srv status.Servers, closeAll func()) {
	var closers []func()
	pool, err := openOutbox(ctx, c.databaseURL, connect.PostgresOptions{AppName: app, MaxConns: 2})
	if err == nil {
		srv.Postgres, closers = pool, append(closers, pool.Close)
	}
	srv.PostgresErr = err
	rdb, err := c.redis(ctx, connect.RedisOptions{ClientName: app})
	if err == nil {
		srv.Redis, closers = rdb, append(closers, func() { _ = rdb.Close() })
	}
	srv.RedisErr = err
	if broker.nats() {
		nc, js, err := broker.connect(app)
		if err == nil {
			srv.JetStream, closers = js, append(closers, nc.Close)
		}
		srv.NATSErr = err
	}
	return srv, func() {
		for _, c := range closers {
			c()
		}
	}
}

func printStatus(w io.Writer, st *status.Status) {
	switch {
	case st.PostgresNotMigrated:
		fmt.Fprintf(w, "outbox   PostgreSQL not migrated: %s\n", st.PostgresError)
	case st.PostgresReadFailed:
		fmt.Fprintf(w, "outbox   PostgreSQL could not be read: %s\n", st.PostgresError)
	case st.PostgresError != "":
		fmt.Fprintf(w, "outbox   PostgreSQL unreachable: %s\n", st.PostgresError)
	default:
		of := ""
		if st.Aggregate != "" {
			of = "  (" + st.Aggregate + ")"
		}
		published := strconv.FormatInt(st.Published, 10)
		if !st.PublishedCounted {
			published = "not counted"
		}
		fmt.Fprintf(w, "outbox   pending %d  publishing %d  published %s  dead %d  retrying %d  oldest pending %.1fs%s\n",
			st.Pending, st.Publishing, published, st.Dead, st.Retrying, st.OldestPendingSeconds, of)
		printRelays(w, st)
		for _, r := range st.RetryingEvents {
			next := fmt.Sprintf("next try in %.1fs", r.NextAttemptInSeconds)
			switch {
			case r.Status == "publishing":
				next = "being published"
			case r.NextAttemptInSeconds <= 0:
				next = "due now"
			}
			fmt.Fprintf(w, "retrying %s  %s/%s %s  attempts %d  %s: %s\n", r.EventID, r.AggregateType,
				cell(r.AggregateID, 40), r.EventType, r.Attempts, next, cellEnds(orDash(r.LastError), 120))
		}
		if n := st.Retrying - int64(len(st.RetryingEvents)); n > 0 && len(st.RetryingEvents) > 0 {
			fmt.Fprintf(w, "retrying ... and %d more\n", n)
		}
		for _, d := range st.DeadEvents {
			fmt.Fprintf(w, "dead     %s  %s/%s %s  attempts %d: %s\n", d.EventID, d.AggregateType,
				cell(d.AggregateID, 40), d.EventType, d.Attempts, cellEnds(orDash(d.LastError), 120))
		}
		if n := st.Dead - int64(len(st.DeadEvents)); n > 0 && len(st.DeadEvents) > 0 {
			fmt.Fprintf(w, "dead     ... and %d more: outbox dead list\n", n)
		}
	}
	printStream(w, st)
	if len(st.Problems) == 0 {
		fmt.Fprintln(w, "status   delivering: no problem found")
		return
	}
	fmt.Fprintf(w, "status   NOT DELIVERED: %d %s\n", len(st.Problems), plural(int64(len(st.Problems)), "problem", "problems"))
	for _, p := range st.Problems {
		fmt.Fprintf(w, "  - %s\n", p)
	}
}

func printRelays(w io.Writer, st *status.Status) {
	var names []string
	for _, r := range st.Relays {
		switch {
		case !r.Alive:
			names = append(names, r.Name+" DEAD")
		case r.Ownership != "":
			names = append(names, r.Name+" ("+r.Ownership+")")
		default:
			names = append(names, r.Name)
		}
	}
	list := ""
	if len(names) > 0 {
		list = ": " + strings.Join(names, ", ")
	}
	fmt.Fprintf(w, "relays   live %d  listening %d%s\n", st.LiveRelays, st.ListeningRelays, list)
	if len(st.RelaySlots) == 0 {
		return
	}
	var held []string
	for _, owner := range slices.Sorted(maps.Keys(st.RelaySlots)) {
		held = append(held, fmt.Sprintf("%s %d", owner, st.RelaySlots[owner]))
	}
	fmt.Fprintf(w, "relays   partition slots held: %s  free %d\n", strings.Join(held, ", "), st.RelaySlotsFree)
	for _, s := range st.RelayPartitions {
		if s.Waiting == 0 {
			continue
		}
		owner := s.Owner
		switch {
		case owner == "":
			owner = "(none)"
		case !s.Alive:
			owner += " DEAD"
		}
		fmt.Fprintf(w, "  slot %-3d owner %s  waiting %d  oldest %.1fs\n", s.Slot, owner, s.Waiting, s.OldestSeconds)
	}
	if st.RelayPartitionsCappedAt > 0 {
		fmt.Fprintf(w, "  (waiting: among the oldest %d unpublished rows only, and there may be more; outbox status without --light counts them all)\n",
			st.RelayPartitionsCappedAt)
	}
}

func printStream(w io.Writer, st *status.Status) {
	if st.RedisError != "" {
		fmt.Fprintf(w, "stream   %s  Redis unreachable: %s\n", st.Stream, st.RedisError)
		return
	}
	if st.NATSError != "" {
		fmt.Fprintf(w, "stream   %s  NATS unreachable: %s\n", st.Stream, st.NATSError)
	} else {
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
	}
	var members []string
	for _, m := range st.Members {
		if m.Alive {
			members = append(members, m.Name)
		} else {
			members = append(members, m.Name+" DEAD")
		}
	}
	fmt.Fprintf(w, "members  live %d: %s\n", st.LiveMembers, orDash(strings.Join(members, ", ")))
	fmt.Fprintf(w, "dlq      %s  entries %d\n", st.DeadLetterStream, st.DeadLettered)
	owner := func(p status.Partition) string {
		switch {
		case p.Owner == "":
			return "(none)"
		case !p.OwnerAlive:
			return p.Owner + " DEAD"
		}
		return p.Owner
	}
	if st.Partitions > 1 {
		for _, p := range st.ByPartition {
			fmt.Fprintf(w, "  p%-4d  %s  length %d  pending %d  lag %d  dlq %d  owner %s\n",
				p.Partition, p.Stream, p.StreamLength, p.GroupPending, p.GroupLag, p.DeadLettered, owner(p))
		}
	} else if len(st.ByPartition) == 1 && st.ByPartition[0].Owner != "" {
		fmt.Fprintf(w, "owner    %s\n", owner(st.ByPartition[0]))
	}
}
