package relay_test

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/relaytest"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/transfer"
)

// flapBound is how long beyond the run's median an event may take from its
// commit to the stream while the relay's connections are being terminated
// (the median is the relay's own pace on the machine). The bound is 1 s;
// the rest is slack for a loaded machine under -race. Before every incident
// started from zero, the LISTEN connection's backoff grew with each incident
// (8 s and more by the sixth) and the drain's with each dead pooled
// connection, so events waited for seconds.
const flapBound = 2 * time.Second

// trickleSenders is how many partition keys the flapping test's trickle
// takes turns over: 50 a second in all, one a second each.
const trickleSenders = 50

// A lone relay whose PostgreSQL backends are all terminated again and again
// (a flapping link, a pooler or server restarted): each incident starts from
// zero. A reconnect that succeeded resets the LISTEN connection's backoff,
// and a round trip that failed on a pooled connection the server closed is
// tried again at once on a fresh one, so every event reaches the stream
// within flapBound of its commit, incident after incident.
func TestRelayWhoseBackendsAreTerminatedAgainAndAgain(t *testing.T) {
	f := newFixture(t)
	const app = "flapping-relay"
	pool := appPool(t, f, app)
	var logs relaytest.SyncBuffer
	rcfg := f.RelayConfig("flapping")
	rcfg.Logger = slog.New(slog.NewTextHandler(io.MultiWriter(&logs, os.Stderr), nil))
	r := f.NewRelayWithPool(pool, rcfg)
	f.Run(r.Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return r.Stats().ListenUp }, "the relay is not listening")

	const incidents, perBurst = 12, 5
	var mu sync.Mutex
	committed := map[string]time.Time{} // event id -> a moment before its commit
	// settle settles a TED from each of senders (the events' partition
	// keys), one after the other.
	settle := func(senders ...string) {
		for _, from := range senders {
			ted := transfer.Transfer{ID: uuid.New(), FromAccount: from, ToAccount: "acct-07", AmountCents: 100}
			before := time.Now()
			if _, err := transfer.Settle(f.Ctx, f.Pool, ted); err != nil {
				t.Error(err)
				return
			}
			var id string
			if err := f.Pool.QueryRow(f.Ctx, "SELECT id::text FROM outbox_messages WHERE aggregate_id = $1",
				ted.ID.String()).Scan(&id); err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			committed[id] = before
			mu.Unlock()
		}
	}
	// A burst: one TED from each of perBurst senders.
	burst := make([]string, perBurst)
	for i := range burst {
		burst[i] = fmt.Sprintf("burst-%d", i)
	}
	// A steady trickle besides the bursts keeps the relay's pooled
	// connections in use, so that the pool does not find them dead on its
	// own (it pings a connection idle for over a second): the relay's
	// round trips meet them. Its senders take turns: a relay publishes one
	// event of a partition key per read (the key's order), so a trickle of
	// one key at 50 a second outran a relay that a loaded machine slowed
	// to a read every 20 ms and more. That key's backlog grew for the whole
	// run (a third of the events 3 s late by its end), which no incident
	// caused, and failed the latency bound.
	stopTrickle := make(chan struct{})
	trickled := make(chan struct{})
	go func() {
		defer close(trickled)
		for i := 0; ; i++ {
			select {
			case <-stopTrickle:
				return
			case <-time.After(20 * time.Millisecond):
				settle(fmt.Sprintf("trickle-%02d", i%trickleSenders))
			}
		}
	}()
	var struck []string // each incident's moment, for a failure's message
	for i := range incidents {
		// Every backend of the relay, LISTEN connection and pooled ones.
		// The LISTEN connection is back by now (it reconnects within a
		// backoff's first step); if it is not, it is waiting out a backoff
		// that an earlier incident grew.
		outboxtest.Eventually(t, flapBound, func() bool {
			return r.Stats().ListenUp && f.Count(`SELECT count(*) FROM pg_stat_activity
				WHERE datname = current_database() AND application_name = $1`, app+"-listen") == 1
		}, "incident %d: the relay's LISTEN connection is still down", i+1)
		struck = append(struck, time.Now().Format("15:04:05.000"))
		f.Exec(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity
			WHERE datname = current_database() AND application_name LIKE $1`, app+"%")
		settle(burst...) // while it reconnects
		time.Sleep(300 * time.Millisecond)
		settle(burst...) // once it has
		time.Sleep(700 * time.Millisecond)
	}
	close(stopTrickle)
	<-trickled
	deadline := time.Now().Add(29 * time.Second)
	// Every event, not as many entries: an incident between a publish and
	// its mark publishes the event again (a duplicate, for consumers to
	// skip), so the stream can hold as many entries as events before the
	// last event is in.
	var missing []string
	outboxtest.Eventually(t, 30*time.Second, func() bool {
		in := map[string]bool{}
		for _, id := range f.Entries(f.Stream()) {
			in[id] = true
		}
		missing = missing[:0]
		for id := range committed {
			if !in[id] {
				missing = append(missing, id)
			}
		}
		if len(missing) > 0 && time.Now().After(deadline) {
			describeRows(t, f, missing)
		}
		return len(missing) == 0
	}, "not every event reached the stream")

	first := map[string]time.Time{} // event id -> its first entry's time
	keyOf := map[string]string{}
	for _, e := range f.FirstEntries(f.Stream(), "event_id", "partition_key") {
		first[e.ID], keyOf[e.ID] = e.At, e.Key
	}
	var waits []time.Duration
	wait := map[string]time.Duration{}
	for id, at := range committed {
		sent, ok := first[id]
		if !ok {
			t.Fatalf("event %s is not in the stream", id)
		}
		wait[id] = sent.Sub(at)
		waits = append(waits, wait[id])
	}
	slices.Sort(waits)
	median := waits[len(waits)/2]
	t.Logf("%d events over %d incidents; commit to stream: median %s, max %s", len(waits), incidents,
		median.Round(time.Millisecond), waits[len(waits)-1].Round(time.Millisecond))
	// Late: more than flapBound beyond the relay's own pace, its median.
	// On an idle machine the median is milliseconds; in a loaded make test
	// the relay can be behind the whole run (a .ci/run's auto lane: median
	// 2.3 s, max 4.0 s, no backoff logged), which is the machine's load,
	// not an incident's.
	type lateEvent struct {
		id, key   string
		committed time.Time
		wait      time.Duration
	}
	var late []lateEvent
	for id, w := range wait {
		if w > median+flapBound {
			late = append(late, lateEvent{id, keyOf[id], committed[id], w})
		}
	}
	slices.SortFunc(late, func(a, b lateEvent) int { return a.committed.Compare(b.committed) })
	// Each incident started from zero: no backoff, no failure left to a
	// later renewal or takeover; and the relay did meet dead pooled
	// connections (the test is not passing for want of them).
	log := string(logs.Bytes())
	for _, failed := range []string{"drain failed", "renewal failed", "taking over the work of relays that died failed",
		"returning the claims of relays that died failed", "reaper failed"} {
		if strings.Contains(log, failed) {
			t.Errorf("the relay's log says %q: an incident did not start from zero", failed)
		}
	}
	if !strings.Contains(log, "trying again at once on a fresh one") {
		t.Error("the relay never met a pooled connection the server had closed")
	}
	if len(late) > 0 {
		var b strings.Builder
		for _, e := range late {
			fmt.Fprintf(&b, "\n%s (key %s) committed at %s, in the stream %s later", e.id, e.key,
				e.committed.Format("15:04:05.000"), e.wait.Round(time.Millisecond))
		}
		t.Fatalf("%d of %d events reached the stream more than %s (the median) + %s after their commit; incidents at %v:%s",
			len(late), len(waits), median.Round(time.Millisecond), flapBound, struck, b.String())
	}
}

// A relay that is behind (a backlog, or commits faster than it drains)
// drains without a pause: no drain ends between incidents. Its backends
// terminated again and again, each incident still starts from zero: a drain
// that published before it met a closed connection was not part of the
// incident before, so it is tried again at once, never after a backoff that
// grew with the incidents. (The run of fresh tries once spanned incidents,
// and the sixth incident's drain backed off: "drain failed", and by the
// end events waited seconds.)
func TestRelayDrainingABacklogWhoseBackendsAreTerminatedAgainAndAgain(t *testing.T) {
	// No bound on time to keep: it owns its database and key prefix, and
	// terminates its own backends only.
	t.Parallel()
	f := newFixture(t)
	const app = "backlog-relay"
	pool := appPool(t, f, app)
	var logs relaytest.SyncBuffer
	rcfg := f.RelayConfig("backlog")
	// Small batches: the backlog takes seconds to drain, every claim
	// finds rows, and the one drain spans every incident.
	rcfg.BatchSize = 10
	rcfg.Logger = slog.New(slog.NewTextHandler(io.MultiWriter(&logs, os.Stderr), nil))
	r := f.NewRelayWithPool(pool, rcfg)
	f.Run(r.Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return r.Stats().ListenUp }, "the relay is not listening")

	// More incidents than the pool has connections, plus one: the fresh
	// tries a run of closed connections gets.
	incidents := int(pool.Config().MaxConns) + 4
	const backlog = 20000
	insertEvents(t, f.Pool, "transfer", backlog)
	unpublished := `SELECT count(*) FROM outbox_messages WHERE status <> 'published'`
	progress := func(since int, format string, args ...any) {
		t.Helper()
		outboxtest.Eventually(t, 30*time.Second, func() bool { return f.Count(unpublished) <= since-20 }, format, args...)
	}
	left := f.Count(unpublished)
	for i := range incidents {
		// The relay has published since the incident before: this one
		// strikes a drain that got going again (on a loaded machine, one
		// still recovering from the last incident is another test's
		// matter), and the one drain goes on: the backlog is not drained.
		progress(left, "incident %d: the relay publishes nothing", i+1)
		outboxtest.Eventually(t, 10*time.Second, func() bool {
			return f.Count(`SELECT count(*) FROM pg_stat_activity
				WHERE datname = current_database() AND application_name = $1`, app) > 0
		}, "incident %d: the relay has no pooled connection", i+1)
		if left = f.Count(unpublished); left == 0 {
			t.Fatalf("incident %d: the backlog is drained already: give the test more rows", i+1)
		}
		f.Exec(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity
			WHERE datname = current_database() AND application_name LIKE $1`, app+"%")
	}
	// Still draining after the last incident (the whole backlog is not
	// waited for: under a loaded -race run it takes a minute).
	progress(left, "the relay published nothing more after the last incident")
	log := string(logs.Bytes())
	if strings.Contains(log, "drain failed") {
		t.Error(`the relay's log says "drain failed": an incident did not start from zero`)
	}
	// Not one per incident: an incident can strike while the relay's
	// connections are being replaced, or the pool can find one closed
	// before the relay uses it (a loaded CI run met 7 in 8 incidents). More
	// than a run of fresh tries used to allow, so that the fault this
	// tests did happen.
	if n, want := strings.Count(log, "trying again at once on a fresh one"), int(pool.Config().MaxConns)+2; n < want {
		t.Errorf("the relay met %d pooled connections the server had closed in %d incidents, want %d at least", n, incidents, want)
	}
}

// appPool is a pool of f's database whose connections carry the
// application name app (the LISTEN connection's, app-listen), for a test to
// terminate them.
func appPool(t *testing.T, f *fixture, app string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(f.DBURL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	pool, err := pgxpool.NewWithConfig(f.Ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// describeRows logs the outbox rows of ids, for a failure's message.
func describeRows(t *testing.T, f *fixture, ids []string) {
	rows, err := f.Pool.Query(f.Ctx, `SELECT id::text, seq, status, attempts, coalesce(claimed_by, ''), coalesce(last_error, ''),
			next_attempt_at - now() FROM outbox_messages WHERE id::text = ANY($1) ORDER BY seq`, ids)
	if err != nil {
		t.Log(err)
		return
	}
	defer rows.Close()
	for rows.Next() {
		var id, status, by, lastErr string
		var seq int64
		var attempts int
		var next time.Duration
		if err := rows.Scan(&id, &seq, &status, &attempts, &by, &lastErr, &next); err != nil {
			t.Log(err)
			return
		}
		t.Logf("not in the stream: %s seq %d %s attempts %d claimed_by %q next in %s last_error %q", id, seq, status, attempts, by, next, lastErr)
	}
}

// A claim whose reply was lost (the server committed it, then the
// connection closed) is not the relay's to publish: it never learned of it.
// When its LISTEN connection comes back, the relay restamps only the claims
// it holds, and the lost one, left under its earlier backend's pid, is
// returned to pending at once as a dead relay's. Before, the restamp took
// it for the relay's own: it waited for its lease (30 s), which is how the
// flapping test above once missed its bound.
func TestAClaimWhoseReplyWasLostIsTakenOverAtOnce(t *testing.T) {
	lostClaimIsPublished(t, true, "restamped as the relay's own, it waits for its lease")
}

// The same, for a claim taken while the relay's LISTEN connection was down
// (it carries no pid then: claimed_pid NULL), whose reply was lost: when the
// LISTEN connection comes back, the relay's claims without a pid that it
// does not know of are returned to pending at once, as a dead relay's.
// Before, only its lease (30 s) returned it, and its keys waited that long:
// how the backlog test above once stalled under a loaded make test, its
// incidents striking while the LISTEN connection was still reconnecting.
func TestAClaimWhoseReplyWasLostWhileListenWasDownIsTakenOverAtOnce(t *testing.T) {
	lostClaimIsPublished(t, false, "without a pid, it waits for its lease")
}

// A relay process killed while its LISTEN connection was down leaves claims
// without a pid, which no watch can find dead. The next process of its name
// returns them to pending when its first LISTEN connection is up, as it does
// its own lost claims after a reconnection: they are not its own (it holds
// no token yet). Before, only their lease (30 s) returned them, and their
// keys waited that long.
func TestClaimsWithoutAPidOfAPreviousProcessOfTheSameNameAreTakenOverAtOnce(t *testing.T) {
	f := newFixture(t)
	id := uuid.New()
	insertClaimOfR1(f, id, "left", nil)
	started := time.Now()
	r := f.NewRelay(f.RowsRelayConfig("r1"), nil)
	f.Run(r.Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return slices.Contains(f.Entries(f.Stream()), id.String())
	}, "the previous process's claim without a pid was not published: it waits for its lease")
	t.Logf("published %s after the relay started", time.Since(started).Round(time.Millisecond))
}

// lostClaimIsPublished writes a claim of relay r1 with a token r1 never
// saw (a claim whose reply was lost), under r1's LISTEN backend if withPID,
// else with no pid (taken while that connection was down); then ends that
// backend and wants the claim published within 10 s, well within its lease.
func lostClaimIsPublished(t *testing.T, withPID bool, why string) {
	t.Helper()
	f := newFixture(t)
	_, pid := listeningR1(f)
	var claimedPID any // NULL
	if withPID {
		claimedPID = pid
	}
	id := uuid.New()
	insertClaimOfR1(f, id, "lost", claimedPID)
	f.Exec("SELECT pg_terminate_backend($1)", pid)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return slices.Contains(f.Entries(f.Stream()), id.String())
	}, "the lost claim was not published (%s)", why)
}

// listeningR1 runs relay r1 (row claims) and returns it with its LISTEN
// backend's pid once it is listening and registered.
func listeningR1(f *fixture) (*relay.Relay, int32) {
	f.T.Helper()
	r := f.NewRelay(f.RowsRelayConfig("r1"), nil)
	f.Run(r.Run)
	var pid int32
	outboxtest.Eventually(f.T, 10*time.Second, func() bool {
		return r.Stats().ListenUp && f.Pool.QueryRow(f.Ctx,
			"SELECT pid FROM outbox_relay_members WHERE owner = 'r1' AND pid IS NOT NULL").Scan(&pid) == nil
	}, "the relay is not listening")
	return r, pid
}

// insertClaimOfR1 writes event id of key key as claimed by relay r1 under a
// token r1 never saw, with claimed_pid pid (nil: none).
func insertClaimOfR1(f *fixture, id uuid.UUID, key string, pid any) {
	f.T.Helper()
	f.Exec(`INSERT INTO outbox_messages (id, aggregate_type, aggregate_id, event_type, payload, partition_key,
			status, claimed_at, claimed_by, claim_token, claimed_pid)
		VALUES ($1, 'transfer', $2, 'x', '{}', $2, 'publishing', now(), 'r1', gen_random_uuid(), $3)`, id, key, pid)
}
