package relay

import (
	"context"
	"testing"

	"github.com/google/uuid"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/relay/redisbroker"
	"github.com/tedbank/outbox/transfer"
)

// A relay's reaper never takes the claims under its own LISTEN backend for
// a dead relay's, whatever pg_locks says when its statement reads it. A
// relay SIGKILLed right after a claim had its own reaper statement, already
// sent, return that claim once the server ended its LISTEN backend: the
// claim was gone before any other relay looked (TestAbandonedClaimIsReapedAndPublished
// failed so, twice in CI). Here the claim's pid is one no relay holds, as
// the dying relay's was by the time the statement read it.
func TestReaperLeavesItsOwnClaims(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := outboxtest.Postgres(t)
	rdb := outboxtest.NewRedis(t)
	for range 3 {
		if _, err := transfer.Settle(ctx, pool, transfer.Transfer{ID: uuid.New(), FromAccount: "a", ToAccount: "b", AmountCents: 100}); err != nil {
			t.Fatal(err)
		}
	}
	const pid = 2_000_000_000 // no backend has it: a dead relay's
	if _, err := pool.Exec(ctx, `UPDATE outbox_messages SET status = 'publishing', claimed_by = 'me',
		claim_token = gen_random_uuid(), claimed_at = now(), claimed_pid = $1`, pid); err != nil {
		t.Fatal(err)
	}
	b, err := redisbroker.New(rdb.Client, redisbroker.Config{})
	if err != nil {
		t.Fatal(err)
	}
	r, err := NewWithBroker(pool, b, Config{Name: "me", Ownership: OwnRows})
	if err != nil {
		t.Fatal(err)
	}

	r.listener.pid.Store(pid) // the relay's own LISTEN backend, as it believes
	if n, err := r.stepReap(ctx); err != nil || n != 0 {
		t.Fatalf("the reaper returned %d of its own relay's claims (%v), want 0", n, err)
	}
	r.listener.pid.Store(0) // its LISTEN connection is down: the claims are a dead backend's
	if n, err := r.stepReap(ctx); err != nil || n != 3 {
		t.Fatalf("the reaper returned %d claims of a dead LISTEN backend (%v), want 3", n, err)
	}
}
