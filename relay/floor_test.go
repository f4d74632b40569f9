package relay_test

import (
	"context"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/admin"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/queries"
	"github.com/tedbank/outbox/internal/relaytest"
	"github.com/tedbank/outbox/relay"
)

// Backlogs behind a long transaction (migration 0019, relay/floor.go): while
// a transaction holds the xmin horizon, the index entries the marks leave
// stay, and a read of the oldest unpublished rows used to walk them all,
// every time. The relay now reads from its floor. Counted, not timed: the
// index entries the relay's own backends read (pg_stat_user_indexes, which
// a backend flushes when it exits) over 20 single-event drains after 3,000
// events were published: before, each of the 40 claims walked the 3,000
// entries (about 120,000); now the first few reads do, until the floor has
// moved twice.
//
// The statistics are taken once the backlog is published, as autovacuum
// does on an idle outbox, at a moment no test can choose: they put almost
// nothing in the partial indexes, and the planner then read the floor's
// range through the per-key index and each key's check through a scan of
// a whole index, for every row read (migration 0022). That is how this
// test once failed in make test, 75,290 entries read: where autovacuum had
// analyzed the table during the test.
func TestReadsSkipWhatALongTransactionKeeps(t *testing.T) {
	t.Parallel()
	const n, drains = 3000, 20
	f := newFixture(t)
	holdHorizon(t, f.Pool)
	// Over 100 keys: 30 reads publish it (over ten, 300 reads of 30 ms
	// each, behind the horizon, took most of the test's time).
	insertEventsOver(t, f.Pool, "floor", n, 100)

	// The backlog, published by a relay whose reads are not counted.
	first, firstPool := relayOnPool(f, "floor-first")
	if got := f.DrainAll(first); got != n {
		t.Fatalf("published %d of %d", got, n)
	}
	closePool(f, firstPool, "floor-first")
	f.Exec("ANALYZE outbox_messages")

	before := unpublishedIndexReads(t, f.Pool)
	r, pool := relayOnPool(f, "floor-second")
	for range drains {
		// Events at their pace, not as fast as the test can write them:
		// the floor moves at most every 50 ms between reads of less than
		// half a batch (relay/floor.go).
		time.Sleep(60 * time.Millisecond)
		insertEvents(t, f.Pool, "floor", 1)
		if got := f.DrainAll(r); got != 1 {
			t.Fatalf("a drain published %d events, want 1", got)
		}
	}
	closePool(f, pool, "floor-second")
	read := unpublishedIndexReads(t, f.Pool) - before
	t.Logf("%d index entries read over %d drains behind %d published rows", read, drains, n)
	if read > 8*n {
		t.Fatalf("%d drains read %d entries of the unpublished indexes: the reads walk the %d entries the marks left (want at most %d); the relay: %+v, ownership %s",
			drains, read, n, 8*n, r.Stats(), r.Ownership())
	}
}

// A writer still open when the floor would rise keeps it below its rows:
// committed later, its event is published at the next drain, before the
// later event of its key.
func TestFloorWaitsForAnOpenWriter(t *testing.T) {
	t.Parallel()
	publishPastAnOpenWriter(t, func(f *fixture, r *relay.Relay) {
		for range 3 { // events of other keys, published past the open writer's row
			time.Sleep(60 * time.Millisecond) // the floor moves at most every 50 ms (floor.go)
			insertEvents(t, f.Pool, "floor", 5)
			f.DrainAll(r)
		}
	})
}

// A writer open longer than the floor's grace is passed over, and the
// floor comes back for its rows when it ends: published at the next drain,
// before the later event of its key.
func TestFloorPassesOverALongWriterAndComesBack(t *testing.T) {
	t.Parallel()
	publishPastAnOpenWriter(t, func(f *fixture, r *relay.Relay) {
		outboxtest.Eventually(t, 30*time.Second, func() bool {
			insertEvents(t, f.Pool, "floor", 2)
			f.DrainAll(r)
			return r.Stats().FloorPassedOver > 0
		}, "the floor never passed the open writer over")
	})
}

// publishPastAnOpenWriter writes an event of key "late" in a transaction
// left open while past publishes events of other keys with a relay, then
// commits it, writes the key's next event, drains once, and checks that the
// key's two events were published in their order.
func publishPastAnOpenWriter(t *testing.T, past func(*fixture, *relay.Relay)) {
	f := newFixture(t)
	r := f.NewRelay(f.RelayConfig("r1"), nil)
	tx := beginWriter(t, f.Pool)
	late := writeEvent(t, f, tx, "late")
	past(f, r)
	if err := tx.Commit(f.Ctx); err != nil {
		t.Fatal(err)
	}
	after := writeEvent(t, f, nil, "late")
	f.DrainAll(r)
	assertKeyOrder(t, f.FirstEntries(f.StreamPrefix()+"floor", "event_id", "aggregate_id"), "late", late, after)
}

// A dead event requeued below the relay's floor goes first (docs/design.md,
// "Dead events"): the same relay, whose floor rose past it while it was
// dead, reads it again before the later event of its key.
func TestRequeuedBelowTheFloorGoesFirst(t *testing.T) {
	f := newFixture(t)
	poison := f.StreamPrefix() + "floor"
	cfg := f.RelayConfig("r1")
	cfg.MaxAttempts = 1
	r := f.NewRelay(cfg, nil)
	if err := f.Redis.Set(f.Ctx, poison, "not a stream", 0).Err(); err != nil {
		t.Fatal(err)
	}
	e1 := writeEvent(t, f, nil, "p1")
	f.DrainAll(r)
	if f.Count("SELECT count(*) FROM outbox_messages WHERE id = $1 AND status = 'dead'", e1) != 1 {
		t.Fatal("e1 did not go dead")
	}
	if err := f.Redis.Del(f.Ctx, poison).Err(); err != nil {
		t.Fatal(err)
	}
	e2 := writeEvent(t, f, nil, "p1")
	for range 3 { // the floor rises past e1
		time.Sleep(60 * time.Millisecond) // the floor moves at most every 50 ms (floor.go)
		insertEvents(t, f.Pool, "floor", 5)
		f.DrainAll(r)
	}
	if res, err := admin.RetryDead(f.Ctx, f.Pool, []uuid.UUID{e1}); err != nil || len(res.Requeued) != 1 {
		t.Fatalf("dead retry: %+v, %v", res, err)
	}
	e3 := writeEvent(t, f, nil, "p1")
	f.DrainAll(r)
	assertKeyOrder(t, f.FirstEntries(poison, "event_id", "aggregate_id"), "p1", e2, e1, e3)
}

// holdHorizon keeps a transaction with an xid open on a connection of its
// own until the test ends.
func holdHorizon(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := conn.Begin(ctx)
	if err == nil {
		_, err = tx.Exec(ctx, "SELECT txid_current()")
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(ctx); conn.Release() })
}

// insertEvents inserts n events of aggregate type typ over ten keys, with
// plain SQL, in one transaction.
func insertEvents(t *testing.T, pool *pgxpool.Pool, typ string, n int) {
	t.Helper()
	insertEventsOver(t, pool, typ, n, 10)
}

// insertEventsOver is insertEvents over keys keys ("k0", "k1", ...): a relay
// publishes one event of a key per read, so a backlog of few keys takes a
// read per event of its busiest key.
func insertEventsOver(t *testing.T, pool *pgxpool.Pool, typ string, n, keys int) {
	t.Helper()
	_, err := pool.Exec(context.Background(), `INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, partition_key)
		SELECT $1, 'k' || (g % $3), 'x', '{}', 'k' || (g % $3) FROM generate_series(1, $2::int) g`, typ, n, keys)
	if err != nil {
		t.Fatal(err)
	}
}

// beginWriter opens a transaction that the test commits; rolled back when
// the test ends if it did not.
func beginWriter(t *testing.T, pool *pgxpool.Pool) pgx.Tx {
	t.Helper()
	tx, err := pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return tx
}

// writeEvent writes an event of key key (aggregate type floor) in tx, or
// on its own when tx is nil, and returns its id.
func writeEvent(t *testing.T, f *fixture, tx pgx.Tx, key string) uuid.UUID {
	t.Helper()
	id := uuid.New()
	const q = `INSERT INTO outbox_messages (id, aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES ($1, 'floor', $2, 'x', '{}', $2)`
	var err error
	if tx != nil {
		_, err = tx.Exec(f.Ctx, q, id, key)
	} else {
		_, err = f.Pool.Exec(f.Ctx, q, id, key)
	}
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// startedRelay is relayOnPool's relay after a drain of an empty outbox: what
// a relay reads once as it starts (the choice of an auto relay walks every
// unpublished entry: relay_ownership_auto.sql) is then behind it.
// It also returns when the relay made its first claim (restartsSince).
func startedRelay(f *fixture, name string) (*relay.Relay, *pgxpool.Pool, time.Time) {
	f.T.Helper()
	r, pool := relayOnPool(f, name)
	started := time.Now()
	if got := f.DrainAll(r); got != 0 {
		f.T.Fatalf("published %d events of an outbox with none to publish", got)
	}
	return r, pool, started
}

// floorFullEvery is relay/floor.go's: every 30 s the floor starts again
// from 0, and the next read walks the unpublished index from its start,
// the entries the drain's marks left included (at most one per row the
// test wrote), and probes its rows' keys from 0 (a batch of probes, each
// over its key's entries). A drain slowed by a loaded machine (31 s once
// in .ci/run) meets such a restart: each is allowed twice the rows written.
const floorFullEvery = 30 * time.Second

// restartsSince bounds how many times a relay's floor started again from 0
// since its first claim at started (startedRelay).
func restartsSince(started time.Time) int {
	return int(time.Since(started) / floorFullEvery)
}

// countedDrain drains the n events waiting with r, closes its pool (named
// name) and returns how many entries of the unpublished indexes the drain
// read.
func countedDrain(f *fixture, r *relay.Relay, pool *pgxpool.Pool, name string, n int) int {
	f.T.Helper()
	before := unpublishedIndexReads(f.T, f.Pool)
	if got := f.DrainAll(r); got != n {
		f.T.Fatalf("published %d of %d", got, n)
	}
	closePool(f, pool, name)
	return unpublishedIndexReads(f.T, f.Pool) - before
}

// relayOnPool returns relay "floor" on a pool of its own, whose backends
// carry name as their application_name (the same relay name: a second
// relay takes over the first one's partition leases).
func relayOnPool(f *fixture, name string) (*relay.Relay, *pgxpool.Pool) {
	f.T.Helper()
	pool := f.PoolWith(map[string]string{"application_name": name})
	return f.NewRelayWithPool(pool, f.RelayConfig("floor")), pool
}

// closePool closes pool, made by relayOnPool, and waits for its backends to
// exit: a backend flushes its statistics as it exits.
func closePool(f *fixture, pool *pgxpool.Pool, name string) {
	f.T.Helper()
	pool.Close()
	outboxtest.Eventually(f.T, 30*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = $1", name) == 0
	}, "the backends of %s did not exit", name)
}

// unpublishedIndexReads is how many entries of the partial indexes of
// unpublished rows (and of rows waiting for a retry) the scans read, as
// the statistics have them.
func unpublishedIndexReads(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	err := pool.QueryRow(context.Background(), `SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes
		WHERE relname = 'outbox_messages'
		  AND indexrelname IN ('outbox_messages_unpublished', 'outbox_messages_unpublished_by_partition',
		                       'outbox_messages_retrying')`).Scan(&n)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// assertKeyOrder fails unless the events of key in entries are want, in
// that order.
func assertKeyOrder(t *testing.T, entries []relaytest.FirstEntry, key string, want ...uuid.UUID) {
	t.Helper()
	var got, wanted []string
	for _, e := range entries {
		if e.Key == key {
			got = append(got, e.ID)
		}
	}
	for _, id := range want {
		wanted = append(wanted, id.String())
	}
	if !slices.Equal(got, wanted) {
		t.Fatalf("key %s published %v, want %v", key, got, wanted)
	}
}

// A backlog the table's statistics do not know of (taken while it was
// empty: autovacuum has not analyzed it yet) is read in seq order, a batch
// at a time (indexedClaim). With the planner left to its estimate of one
// pending row, each read scanned every pending row, checked each one's key
// and sorted them: 1.8 s a read over 116,000 rows.
func TestBacklogUnderStaleStatisticsIsReadInOrder(t *testing.T) {
	t.Parallel()
	drainStaleBacklog(t, 0)
}

// The same, with statistics taken while the outbox held only published
// rows (the usual state when autovacuum analyzes it), behind a long
// transaction that keeps their index entries: the reads skip those entries
// (migration 0022), as with fresh statistics.
func TestBacklogUnderStatisticsOfAPublishedOutbox(t *testing.T) {
	t.Parallel()
	drainStaleBacklog(t, 3000)
}

// drainStaleBacklog analyzes an outbox of the given number of published rows of ten
// keys, held back by a long transaction when published > 0, then drains a
// backlog of 20,000 events of 20,000 keys the statistics do not know of,
// and fails when the reads walked more than 4 index entries per event.
func drainStaleBacklog(t *testing.T, published int) {
	const n = 20_000
	f := newFixture(t)
	f.Exec("ALTER TABLE outbox_messages SET (autovacuum_enabled = false)")
	if published > 0 {
		holdHorizon(t, f.Pool)
		insertEvents(t, f.Pool, "history", published)
		f.Exec("UPDATE outbox_messages SET status = 'published', published_at = now()")
	}
	f.Exec("ANALYZE outbox_messages")
	// The relay starts before the backlog arrives (startedRelay).
	r, pool, started := startedRelay(f, "stale-stats")
	if _, err := f.Pool.Exec(f.Ctx, `INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, partition_key)
		SELECT 'floor', 'k' || g, 'x', '{}', 'k' || g FROM generate_series(1, $1::int) g`, n); err != nil {
		t.Fatal(err)
	}
	read := countedDrain(f, r, pool, "stale-stats", n)
	limit := 4*n + restartsSince(started)*2*(n+published)
	t.Logf("%d index entries read to drain %d events", read, n)
	if read > limit {
		t.Fatalf("draining %d events read %d entries of the unpublished indexes (want at most %d): each read scanned every pending row",
			n, read, limit)
	}
}

// While the floor has passed writers over (its hole), a partition owner's
// read leaves out a key's later event when an earlier one of the key lies
// in the hole: committed between the floor's move and the read's snapshot,
// that earlier event is visible to the read but below where it starts. The
// read's second check (relay_read.sql), run with the settings of such a
// moment: the hole from the earlier event, the floor past it.
func TestReadLeavesOutAKeysEventBehindOneInTheHole(t *testing.T) {
	t.Parallel()
	testReadWithAHole(t, false)
}

// The same, with a requeue landing while the read runs: the requeue's
// nextval makes the floor's functions answer 0 from then on, so a check
// evaluated after it must not take the hole for empty while the read's
// scan started at the floor (found by a review; here the requeue is made
// to land after the scan started and before the first row's checks, by a
// slot function that draws the requeue sequence once).
func TestReadLeavesOutAKeysEventBehindOneInTheHoleWhenARequeueLandsMidRead(t *testing.T) {
	t.Parallel()
	testReadWithAHole(t, true)
}

func testReadWithAHole(t *testing.T, requeueMidRead bool) {
	f := newFixture(t)
	early := writeEvent(t, f, nil, "held")
	later := writeEvent(t, f, nil, "held")
	other := writeEvent(t, f, nil, "free")
	seq := func(id uuid.UUID) int64 {
		var s int64
		if err := f.Pool.QueryRow(f.Ctx, "SELECT seq FROM outbox_messages WHERE id = $1", id).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	tx, err := f.Pool.Begin(f.Ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(f.Ctx) }()
	if requeueMidRead {
		// Rolled back with the transaction.
		if _, err := tx.Exec(f.Ctx, `CREATE OR REPLACE FUNCTION outbox_relay_slot(key text, slots integer) RETURNS integer
			LANGUAGE plpgsql VOLATILE AS $$
			BEGIN
			    IF current_setting('test.requeued', true) IS DISTINCT FROM '1' THEN
			        PERFORM set_config('test.requeued', '1', true);
			        PERFORM nextval('outbox_relay_requeues');
			    END IF;
			    RETURN (('x' || substr(md5(key), 1, 8))::bit(32)::bigint % greatest(slots, 1))::int;
			END $$`); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := tx.Exec(f.Ctx, `SELECT set_config('outbox.read_from', $1, true), set_config('outbox.keys_from', $2, true),
		       set_config('outbox.requeues', coalesce(pg_sequence_last_value('outbox_relay_requeues'), 0)::text, true)`,
		strconv.FormatInt(seq(later), 10), strconv.FormatInt(seq(early), 10)); err != nil {
		t.Fatal(err)
	}
	st := queries.RelayRead(10, 1, []int32{0}, nil, time.Hour.Milliseconds(), 1<<20)
	rows, err := tx.Query(f.Ctx, st.SQL, st.Args...)
	if err != nil {
		t.Fatal(err)
	}
	var read []uuid.UUID
	for rows.Next() {
		vals, err := rows.Values()
		if err != nil {
			t.Fatal(err)
		}
		read = append(read, uuid.UUID(vals[0].([16]byte)))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if requeueMidRead {
		var requeued string
		if err := tx.QueryRow(f.Ctx, "SELECT coalesce(current_setting('test.requeued', true), '')").Scan(&requeued); err != nil || requeued != "1" {
			t.Fatalf("the requeue did not land during the read (%q, %v)", requeued, err)
		}
	}
	if !slices.Equal(read, []uuid.UUID{other}) {
		t.Fatalf("the read took %v; want only the other key's event %v (the held key's later event %v waits for %v, in the hole)",
			read, other, later, early)
	}
}

// Many rows waiting for their retry do not make every read walk them: the
// read checks each row's key for an older retrying row with a probe of
// that key, and only while some row waits for a retry (relay_read.sql).
// Left an anti-join, with statistics of an outbox that has run a while
// (300,000 rows published, 5,000 keys), the planner scanned the whole
// retrying index for each row read: 4,770,019 index entries read for this
// drain, against 20,040 (docs/log.md, eighth session).
func TestReadsBesideManyRowsWaitingForARetry(t *testing.T) {
	t.Parallel()
	const n = 10_000
	f := newFixture(t)
	f.Exec("ALTER TABLE outbox_messages SET (autovacuum_enabled = false)")
	r, pool, started := startedRelay(f, "retrying")
	// An outbox that has run a while: its published rows are most of the
	// table the statistics see.
	if _, err := f.Pool.Exec(f.Ctx, `INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, status, published_at)
		SELECT 'bench', 'acct-' || (g % 5000), 'x', '{}', 'published', now() FROM generate_series(1, 300000) g`); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Pool.Exec(f.Ctx, `INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, partition_key, attempts)
		SELECT 'bench', 'acct-' || (g % 5000), 'x', '{}', NULL, CASE WHEN g % 10 = 0 THEN 1 ELSE 0 END -- a tenth waits for a retry
		  FROM generate_series(1, $1::int) g`, n); err != nil {
		t.Fatal(err)
	}
	f.Exec("ANALYZE outbox_messages")
	read := countedDrain(f, r, pool, "retrying", n)
	limit := 4*n + restartsSince(started)*2*n
	t.Logf("%d index entries read to drain %d events, %d of them waiting for a retry", read, n, n/10)
	if read > limit {
		t.Fatalf("draining %d events beside %d retrying read %d index entries (want at most %d): each row's check walked the retrying rows",
			n, n/10, read, limit)
	}
}
