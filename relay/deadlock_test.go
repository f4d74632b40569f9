package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/relaytest"
	"github.com/tedbank/outbox/relay/broker"
	"github.com/tedbank/outbox/relay/redisbroker"
)

// A mark that loses a deadlock is sent again. The restamp of a LISTEN
// connection that came back updates a relay's claimed rows while the
// relay's own mark of them may be under way, and PostgreSQL ends one of
// the two. A mark given up left its rows claimed, and every later event of
// their keys waiting, until their lease ran out: a .ci/run's backlog test
// published nothing for 30 s ("deadlock detected" in the relay's log).
// Here a transaction of the test's own makes the deadlock: it locks the
// batch's second row before the mark is sent and its first once the mark
// waits for the second, which the mark's backend, waiting longer, breaks
// by ending the mark.
func TestMarkThatLosesADeadlockIsSentAgain(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.Settle(2) // two senders: one claim takes both
	var ids []uuid.UUID
	rows, err := f.Pool.Query(f.Ctx, "SELECT id FROM outbox_messages ORDER BY seq")
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id uuid.UUID
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	if rows.Close(); len(ids) != 2 {
		t.Fatalf("%d events, want 2", len(ids))
	}
	deadlocksBefore := f.Count("SELECT deadlocks::int FROM pg_stat_database WHERE datname = current_database()")

	b := &gatedBroker{Broker: f.RedisBroker(nil, redisbroker.Config{}), published: make(chan struct{}), proceed: make(chan struct{})}
	r := f.NewRelayOn(f.RowsRelayConfig("r1"), b)
	type result struct {
		published int
		err       error
	}
	done := make(chan result, 1)
	go func() {
		res, err := relaytest.DrainBatch(f.Ctx, r)
		done <- result{res.Published, err}
	}()
	select {
	case <-b.published: // in the stream, its mark not sent yet
	case <-time.After(10 * time.Second):
		t.Fatal("the relay published nothing")
	}

	conn, err := f.Pool.Acquire(f.Ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	tx, err := conn.Begin(f.Ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(f.Ctx)) }()
	// This transaction looks for the deadlock after 10 s, the mark after
	// 1 s (the default): the server ends the mark, not this one.
	if _, err := tx.Exec(f.Ctx, "SET LOCAL deadlock_timeout = '10s'"); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(f.Ctx, "SELECT 1 FROM outbox_messages WHERE id = $1 FOR UPDATE", ids[1]); err != nil {
		t.Fatal(err)
	}
	close(b.proceed)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.Count(`SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`) == 1
	}, "the mark does not wait for the second row")
	// The mark holds the first row (it locks them in the batch's order) and
	// waits for the second: this waits for the first until the server ends
	// the mark.
	if _, err := tx.Exec(f.Ctx, "UPDATE outbox_messages SET last_error = last_error WHERE id = $1", ids[0]); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(f.Ctx); err != nil {
		t.Fatal(err)
	}

	var res result
	select {
	case res = <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the drain did not end")
	}
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.Count("SELECT deadlocks::int FROM pg_stat_database WHERE datname = current_database()") > deadlocksBefore
	}, "no deadlock happened: the test proves nothing")
	if res.err != nil || res.published != 2 {
		t.Fatalf("drain: published %d, error %v; want the mark sent again and both rows published", res.published, res.err)
	}
	if n := f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'"); n != 2 {
		t.Fatalf("%d of 2 rows marked published", n)
	}
}

// gatedBroker publishes, then says so on published and waits for proceed
// before it returns (once).
type gatedBroker struct {
	broker.Broker
	published, proceed chan struct{}
}

func (b *gatedBroker) Publish(ctx context.Context, msgs []broker.Message, dests []string) ([]string, []error) {
	ids, errs := b.Broker.Publish(ctx, msgs, dests)
	close(b.published)
	<-b.proceed
	return ids, errs
}

// The restamp of a LISTEN connection that came back never waits for a row
// another transaction holds (a mark of the relay's, which it could deadlock
// with): the connection is back while the row is still locked.
func TestRestampSkipsLockedClaims(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	r, pid := listeningR1(f)
	// A claim of r1's without a pid, which the restamp updates, locked.
	id := uuid.New()
	insertClaimOfR1(f, id, "locked", nil)
	tx, err := f.Pool.Begin(f.Ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(f.Ctx)) }()
	if _, err := tx.Exec(f.Ctx, "SELECT 1 FROM outbox_messages WHERE id = $1 FOR UPDATE", id); err != nil {
		t.Fatal(err)
	}
	f.Exec("SELECT pg_terminate_backend($1)", pid)
	outboxtest.Eventually(t, 5*time.Second, func() bool {
		var now int32
		return r.Stats().ListenUp && f.Pool.QueryRow(f.Ctx,
			"SELECT pid FROM outbox_relay_members WHERE owner = 'r1' AND pid IS NOT NULL").Scan(&now) == nil && now != pid
	}, "the LISTEN connection is not back while a claimed row is locked: its restamp waits for the lock")
}
