// Package status reads the state of a deployment (the outbox table and its
// relays in PostgreSQL; the stream, the consumer group and the consumers'
// own records in Redis or NATS JetStream) and judges whether the outbox is
// being delivered. 'outbox status' prints it; it changes nothing.
//
// Each side is read on its own: an operator needs the PostgreSQL backlog
// most when Redis is down, and the stream's state when PostgreSQL is. Judge
// finds the problems in what could be read.
package status

import (
	"fmt"
	"slices"
	"strings"

	"github.com/tedbank/outbox/admin"
)

// Status is what 'outbox status --json' prints (docs/operations.md, "Is it
// being delivered?"). During an outage it still shows what the reachable
// server says: the other side's figures are zero and its error is in
// postgres_error, redis_error or nats_error.
type Status struct {
	// Healthy: no problem was found and every side could be read.
	// Problems says, one line each, why the outbox is not being delivered
	// (Judge); empty when healthy.
	Healthy  bool     `json:"healthy"`
	Problems []string `json:"problems"`

	// Aggregate: the aggregate type the outbox figures are of ("": every
	// type).
	Aggregate  string `json:"aggregate,omitempty"`
	Pending    int64  `json:"pending"`
	Publishing int64  `json:"publishing"`
	Published  int64  `json:"published"`
	// PublishedCounted: Published was counted (a read with Options.Light,
	// the console's, does not count the published rows: 0).
	PublishedCounted     bool    `json:"published_counted"`
	Dead                 int64   `json:"dead"`
	Retrying             int64   `json:"retrying"` // unpublished rows that failed at least once
	OldestPendingSeconds float64 `json:"oldest_pending_seconds"`
	// ListeningRelays: the relays whose LISTEN connection is open (by its
	// application name); LiveRelays: the relays whose LISTEN backend holds
	// their ownership lock (alive, as the relays judge each other).
	ListeningRelays int64 `json:"listening_relays"`
	LiveRelays      int64 `json:"live_relays"`
	// Relays is every relay the database knows of, alive or dead.
	Relays []Relay `json:"relays"`
	// RelaySlots: with relays that own partitions (--ownership
	// partitions), how many of the partition slots each relay holds;
	// RelaySlotsFree: how many nobody holds (empty and every slot free
	// with row claims: no slot is ever held).
	RelaySlots     map[string]int `json:"relay_slots,omitempty"`
	RelaySlotsFree int            `json:"relay_slots_free"`
	// RelayPartitions is each partition slot: its owner and its backlog.
	RelayPartitions []RelayPartition `json:"relay_partitions"`
	// RelayPartitionsCappedAt: a light read (--light, the console) counted
	// the slots' backlogs among the oldest this many unpublished rows and
	// reached that many: there may be more, and each slot's Waiting may be
	// larger (0: every unpublished row was counted).
	RelayPartitionsCappedAt int64 `json:"relay_partitions_capped_at,omitempty"`
	// RetryingEvents and DeadEvents are the first of the retrying rows
	// (the next due first) and of the dead rows (oldest first), at most
	// Options.Samples of each.
	RetryingEvents []RetryingEvent   `json:"retrying_events"`
	DeadEvents     []admin.DeadEvent `json:"dead_events"`

	Stream       string `json:"stream"`
	StreamLength int64  `json:"stream_length"`
	Group        string `json:"group"`
	GroupPending int64  `json:"group_pending"`
	GroupLag     int64  `json:"group_lag"`
	GroupExists  bool   `json:"group_exists"`
	// Members is every consumer of the group (package consumer's members
	// set), alive or dead; LiveMembers counts the live ones.
	Members     []Member `json:"members"`
	LiveMembers int      `json:"live_members"`
	// KeyPrefix is the group's consumers' key prefix (their leases,
	// members and dead letters).
	KeyPrefix        string `json:"key_prefix"`
	DeadLetterStream string `json:"dead_letter_stream"`
	DeadLettered     int64  `json:"dead_lettered"`
	// With several partitions, the stream, group and dead-letter figures
	// above are sums over the partitions, and ByPartition has each one.
	Partitions int `json:"partitions"`
	// Streams is every partition's stream (or JetStream subject) name, by
	// partition: what the relay writes (docs/streams.md).
	Streams     []string    `json:"streams"`
	ByPartition []Partition `json:"by_partition"`
	// Broker is where the events travel (--broker): "redis", or "nats",
	// where the stream, group and lag figures are the JetStream stream's
	// messages on the subject and the group's durable consumers'.
	Broker string `json:"broker"`
	// PostgresError, RedisError and NATSError say why a side could not be
	// read (empty: it was read).
	PostgresError string `json:"postgres_error,omitempty"`
	RedisError    string `json:"redis_error,omitempty"`
	NATSError     string `json:"nats_error,omitempty"`
	// PostgresNotMigrated: PostgreSQL answered, without the outbox's tables.
	PostgresNotMigrated bool `json:"postgres_not_migrated,omitempty"`
	// PostgresReadFailed: PostgreSQL answered, and a query failed.
	PostgresReadFailed bool `json:"-"`

	samples  int   // rows of each kind to list (Options.Samples)
	light    bool  // Options.Light
	slotRows int64 // with light, the rows the slots' backlogs are counted among
}

// Relay is one relay known to the database.
type Relay struct {
	Name string `json:"name"`
	PID  int    `json:"pid"` // its LISTEN connection's backend
	// Alive: that backend holds the relay's ownership lock. A relay
	// killed, stopped or cut off is dead; the live relays bury a dead one
	// (free its slots, return its claims) within a fraction of a second.
	Alive     bool   `json:"alive"`
	Ownership string `json:"ownership"` // "rows" or "partitions" while alive
	Slots     int    `json:"slots"`     // partition slots it leases
	// LeaseSecondsLeft: the longest of its slot leases, in seconds.
	LeaseSecondsLeft float64 `json:"lease_seconds_left"`
	Claimed          int64   `json:"claimed"` // rows it has claimed (publishing)
}

// RelayPartition is one partition slot of the relays (migration 0010).
type RelayPartition struct {
	Slot  int    `json:"slot"`
	Owner string `json:"owner"` // "" when free
	Alive bool   `json:"alive"` // its owner is alive
	// LeaseSecondsLeft is how long the owner's lease runs without renewal.
	LeaseSecondsLeft float64 `json:"lease_seconds_left"`
	// Waiting: its unpublished rows (every aggregate type); OldestSeconds
	// the age of the oldest: the slot's lag.
	Waiting       int64   `json:"waiting"`
	OldestSeconds float64 `json:"oldest_seconds"`
}

// RetryingEvent is an outbox row waiting for a retry after a failed publish.
type RetryingEvent struct {
	EventID       string `json:"event_id"`
	AggregateType string `json:"aggregate_type"`
	AggregateID   string `json:"aggregate_id"`
	EventType     string `json:"event_type"`
	Status        string `json:"status"` // pending, or publishing while a relay tries it
	Attempts      int    `json:"attempts"`
	LastError     string `json:"last_error"`
	// NextAttemptInSeconds: when a relay may try it again (0 or less: now).
	NextAttemptInSeconds float64 `json:"next_attempt_in_seconds"`
}

// Member is one consumer of the group.
type Member struct {
	Name  string `json:"name"`
	Alive bool   `json:"alive"`
}

// Partition is one partition's stream and group, and which consumer of the
// group holds it.
type Partition struct {
	Partition    int    `json:"partition"`
	Stream       string `json:"stream"`
	StreamLength int64  `json:"stream_length"`
	GroupPending int64  `json:"group_pending"`
	GroupLag     int64  `json:"group_lag"`
	GroupExists  bool   `json:"group_exists"`
	Owner        string `json:"owner"` // the consumer holding its lease; empty: none
	// OwnerAlive: the owner's process is alive; LeaseSecondsLeft: how long
	// its lease runs without a renewal.
	OwnerAlive       bool    `json:"owner_alive"`
	LeaseSecondsLeft float64 `json:"lease_seconds_left"`
	DeadLettered     int64   `json:"dead_lettered"`
}

// Judge sets Problems and Healthy from what was read: the outbox is not
// being delivered when
//
//   - no relay is alive while events wait, or relays died and none is
//     alive to take over their work;
//   - a dead relay holds partition slots or claimed rows (the live relays
//     take them over within a fraction of a second: a problem seen twice
//     is one that stays);
//   - a partition of the group is held by a consumer that is dead;
//   - the group has no live consumer while entries wait for it, or does
//     not exist on a stream that has entries;
//   - a side could not be read.
//
// Dead events and dead letters are shown, not judged: they wait for a
// person (dead retry, dlq retry), and the alerts of deploy/ page for them.
func (st *Status) Judge() {
	var p []string
	if st.PostgresError == "" {
		var dead []string
		for _, r := range st.Relays {
			if !r.Alive {
				dead = append(dead, r.Name)
			}
		}
		waiting := st.Pending + st.Publishing
		switch {
		case st.LiveRelays == 0 && waiting > 0:
			oldest := ""
			if st.Pending > 0 {
				oldest = fmt.Sprintf(" (the oldest pending for %.1fs)", st.OldestPendingSeconds)
			}
			p = append(p, fmt.Sprintf("no live relay while %s%s%s",
				count(waiting, "event waits", "events wait"), oldest, diedSuffix(dead)))
		case st.LiveRelays == 0 && len(dead) > 0:
			p = append(p, fmt.Sprintf("no live relay: %s died and none took over", strings.Join(dead, ", ")))
		}
		for _, r := range st.Relays {
			if r.Alive {
				continue
			}
			if r.Slots > 0 {
				p = append(p, fmt.Sprintf("relay %s is dead and holds %s: their events wait for its lease to end (%.1fs)",
					r.Name, count(int64(r.Slots), "partition slot", "partition slots"), r.LeaseSecondsLeft))
			}
			if r.Claimed > 0 {
				p = append(p, fmt.Sprintf("relay %s is dead and holds %s until a live relay returns them",
					r.Name, count(r.Claimed, "claimed event", "claimed events")))
			}
		}
	}
	consumersRead := st.RedisError == ""
	streamRead := consumersRead && st.NATSError == ""
	if consumersRead {
		for _, ps := range st.ByPartition {
			if ps.Owner != "" && !ps.OwnerAlive {
				p = append(p, fmt.Sprintf("partition %d of group %s is held by %s, which is dead: its entries wait for the lease to end (%.1fs)",
					ps.Partition, st.Group, ps.Owner, ps.LeaseSecondsLeft))
			}
		}
	}
	if streamRead {
		var noGroup []string
		var unread int64
		for _, ps := range st.ByPartition {
			if ps.StreamLength > 0 && !ps.GroupExists {
				noGroup = append(noGroup, ps.Stream)
				unread += ps.StreamLength
			}
		}
		if len(noGroup) > 0 {
			p = append(p, fmt.Sprintf("group %s does not exist on %s: nothing has read its %s",
				st.Group, strings.Join(noGroup, ", "), count(unread, "entry", "entries")))
		}
		if waiting := st.GroupLag + st.GroupPending; st.LiveMembers == 0 && waiting > 0 {
			p = append(p, fmt.Sprintf("group %s has no live consumer while %s (lag %d, pending %d)",
				st.Group, count(waiting, "entry waits", "entries wait"), st.GroupLag, st.GroupPending))
		}
	}
	for _, e := range []struct{ side, err string }{{"PostgreSQL", st.PostgresError}, {"Redis", st.RedisError}, {"NATS", st.NATSError}} {
		if e.err != "" {
			p = append(p, e.side+" could not be read: "+e.err)
		}
	}
	st.Problems = slices.Clip(p)
	if st.Problems == nil {
		st.Problems = []string{}
	}
	st.Healthy = len(st.Problems) == 0
}

func diedSuffix(dead []string) string {
	if len(dead) == 0 {
		return ""
	}
	return "; " + strings.Join(dead, ", ") + " died"
}

// count is n with the singular or the plural.
func count(n int64, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return fmt.Sprintf("%d %s", n, many)
}
