package relay

import (
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
)

// readFloor is where the relay's reads start: a seq below which every row is
// published or dead (migration 0019, which says why it holds). Without it,
// every read of the oldest unpublished rows walks the index entries that
// the marks left behind, and while a long transaction holds the xmin
// horizon none of them can be cleaned: a backlog drains ever slower, and
// fresh events wait for the walk (docs/operations.md, "Backlogs behind a
// long transaction").
//
// The state lives here and travels in each claim's round trip to
// outbox_relay_floor, which checks it against pg_locks and the table and
// returns it moved; the claim's read in the same transaction starts at the
// floor it set. It is only ever a hint the server re-checks: a relay that
// loses it (a restart, a failed round trip) starts again from 0.
type readFloor struct {
	floor             int64
	mark, hole        *int64
	writers, holeOpen []string
	requeues          *int64
	taken             time.Time // when the candidate (mark) was taken
	reset             time.Time // when the floor last started from 0
	moved             time.Time // when outbox_relay_floor last ran
}

const (
	// floorGrace is how long the floor waits for the writers that were
	// open when it took its candidate before it passes them over (keeping
	// the hole). A settlement's transaction lasts milliseconds; one open
	// for a second is a batch, or a session idle in its transaction.
	floorGrace = time.Second
	// floorFullEvery is how often the floor starts again from 0: a row
	// inserted below it with a seq chosen by hand (which only the table's
	// owner may) is published within it.
	floorFullEvery = 30 * time.Second
	// floorEvery is how often the floor moves while the reads return less
	// than half a batch. outbox_relay_floor costs a transaction about
	// 0.1 ms (pg_locks), a quarter of a fresh event's claim: between two
	// moves the reads start where the last one left the floor, which
	// costs them the entries of the events published meanwhile (at
	// 200 events/s, 20 at most). A read of half a batch or more moves it
	// every time (a backlog's marks leave a batch of entries per read), and
	// so does every read while writers passed over are open.
	floorEvery = 50 * time.Millisecond
)

// queue adds outbox_relay_floor to b, or, when the floor moved less than
// floorEvery ago, busy is false and no hole waits for its writers (a
// hole's rows are read as soon as they commit), only the settings it would
// make. The claim's read, queued after it, starts at the floor it returns.
// The returned apply keeps the new state, to be called once the round trip
// committed; it reports whether the floor passed writers over.
func (f *readFloor) queue(b *pgx.Batch, now time.Time, busy bool) (apply func() bool) {
	if f.reset.IsZero() || now.Sub(f.reset) >= floorFullEvery {
		*f = readFloor{reset: now}
	}
	if !busy && f.hole == nil && now.Sub(f.moved) < floorEvery {
		requeues := "" // no read starts above 0 before the floor moved once
		if f.requeues != nil {
			requeues = strconv.FormatInt(*f.requeues, 10)
		}
		b.Queue("SELECT set_config('outbox.read_from', $1, true), set_config('outbox.keys_from', $2, true), set_config('outbox.requeues', $3, true)",
			strconv.FormatInt(f.floor, 10), strconv.FormatInt(f.floor, 10), requeues)
		return func() bool { return false }
	}
	force := f.mark != nil && now.Sub(f.taken) >= floorGrace
	next := *f
	var taken bool
	b.Queue("SELECT floor_seq, mark, writers, hole, hole_writers, requeues, taken FROM outbox_relay_floor($1, $2, $3, $4, $5, $6, $7)",
		f.floor, f.mark, f.writers, f.hole, f.holeOpen, f.requeues, force).
		QueryRow(func(row pgx.Row) error {
			return row.Scan(&next.floor, &next.mark, &next.writers, &next.hole, &next.holeOpen, &next.requeues, &taken)
		})
	return func() bool {
		next.moved = now
		if taken {
			next.taken = now
		}
		passedOver := force && len(next.holeOpen) > len(f.holeOpen)
		*f = next
		return passedOver
	}
}
