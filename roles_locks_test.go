package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/transfer"
)

// The advisory locks the relays rely on are functions every role may call:
// PostgreSQL has no grant for one lock key. So taking them must do no harm.
// A session of the writers' role that takes each of them and
// keeps it, idle, must not refuse relays as "of the other ownership", pass
// for a live relay, keep writers waiting, or keep relays from sleeping;
// while a writer that read "busy" and has not committed must still keep a
// relay awake (the wake-up protocol of migration 0006).
func TestRelayLocksTakenByAWriterDoNoHarm(t *testing.T) {
	f := newFixture(t)
	writer, relayPool := f.withRoles()
	hold := func(pool *pgxpool.Pool, sql string) *pgxpool.Conn {
		t.Helper()
		c, err := pool.Acquire(f.Ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(c.Release)
		if _, err := c.Exec(f.Ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
		return c
	}
	sleeps := func() bool {
		t.Helper()
		var ok bool
		if err := relayPool.QueryRow(f.Ctx, "SELECT outbox_relay_sleep()").Scan(&ok); err != nil {
			t.Fatal(err)
		}
		return ok
	}

	// 1. The wake-up lock held exclusively by a writer's session, while a
	// relay said "busy": a writer still commits, and notifies.
	rogue := hold(writer, "SELECT pg_advisory_lock(1869903214, 1)")
	listener := hold(f.Pool, "LISTEN outbox_messages")
	f.Exec("SELECT outbox_relay_busy()")
	ctx, cancel := context.WithTimeout(f.Ctx, 5*time.Second)
	_, err := transfer.Settle(ctx, writer, transfer.Transfer{ID: uuid.New(), FromAccount: "a", ToAccount: "b", AmountCents: 1})
	cancel()
	if err != nil {
		t.Fatalf("settle while a writer's session holds the wake-up lock: %v", err)
	}
	ctx, cancel = context.WithTimeout(f.Ctx, 5*time.Second)
	_, err = listener.Conn().WaitForNotification(ctx)
	cancel()
	if err != nil {
		t.Fatalf("no notification from a writer that could not take the wake-up lock: %v", err)
	}
	// ...and a relay may sleep: that session is in no transaction, so it
	// is no writer that read "busy".
	if !sleeps() {
		t.Error("outbox_relay_sleep refused while only an idle session held the wake-up lock exclusively")
	}
	if _, err := rogue.Exec(f.Ctx, "SELECT pg_advisory_unlock_all()"); err != nil {
		t.Fatal(err)
	}

	// 2. The same lock held shared by a session: a relay may sleep...
	hold(writer, "SELECT pg_advisory_lock_shared(1869903214, 1)")
	if !sleeps() {
		t.Error("outbox_relay_sleep refused while only an idle session held the wake-up lock shared")
	}
	// ...but not while a writer that read "busy" has not committed.
	f.Exec("SELECT outbox_relay_busy()")
	tx, err := writer.Begin(f.Ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := transfer.SettleTx(f.Ctx, tx, transfer.Transfer{ID: uuid.New(), FromAccount: "a", ToAccount: "b", AmountCents: 2}); err != nil {
		t.Fatal(err)
	}
	if sleeps() {
		t.Error("outbox_relay_sleep let a relay sleep before a writer that read \"busy\" committed")
	}
	if err := tx.Commit(f.Ctx); err != nil {
		t.Fatal(err)
	}

	// 3. The relays' ownership locks, both kinds, held by a writer's
	// session: a relay (as outbox_relay) starts, publishes, and is the only
	// live relay; the idle session is not taken for a stalled relay.
	hold(writer, "SELECT pg_advisory_lock_shared(1869903216, 1), pg_advisory_lock_shared(1869903216, 2)")
	cfg := f.RelayConfig("r1")
	cfg.ListenConfig = relayPool.Config().ConnConfig.Copy()
	r := f.NewRelayWithPool(relayPool, cfg)
	f.Run(r.Run)
	f.Settle(3)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 5
	}, "relay did not publish while a writer's session held the ownership locks")
	if n := f.Count("SELECT count(*) FROM outbox_live_relays"); n != 1 {
		t.Errorf("outbox_live_relays counts %d relays, want 1 (the writer's session is none)", n)
	}
	// With the wake-up lock still held shared by that session, the relay
	// falls asleep: its claims stop.
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		before := r.Stats().Claims
		time.Sleep(500 * time.Millisecond)
		return r.Stats().Claims == before
	}, "the relay kept claiming while only an idle session held the wake-up lock")
	if _, err := writer.Exec(f.Ctx, "SELECT 1"); err != nil {
		t.Fatal(err)
	}
	var alive int
	if err := f.Pool.QueryRow(f.Ctx, `SELECT count(DISTINCT pid) FROM pg_locks
		WHERE locktype = 'advisory' AND classid IN (1869903214, 1869903216) AND granted
		  AND pid NOT IN (SELECT pid FROM outbox_live_relays)`).Scan(&alive); err != nil || alive != 2 {
		t.Errorf("the writer's sessions holding the locks: %d alive, want 2 (%v)", alive, err)
	}
}
