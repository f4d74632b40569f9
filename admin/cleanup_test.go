package admin_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/tedbank/outbox/admin"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/relay/redisbroker"
	"github.com/tedbank/outbox/transfer"
)

const ageOld = `UPDATE outbox_messages SET created_at = now() - interval '3 hours' WHERE id = $1`

// Cleanup deletes exactly the rows published before the cutoff, in batches,
// and leaves pending, publishing and dead rows (however old) and recently
// published rows alone.
func TestCleanupDeletesOnlyOldPublishedRows(t *testing.T) {
	ctx := context.Background()
	pool := outboxtest.Postgres(t)
	keep := map[uuid.UUID]string{}
	var old []uuid.UUID
	// Interleave the kinds of rows, so that batches in seq order meet all of
	// them; the first row is a recent one, to catch a cleanup that stops at
	// the first row it may not delete.
	for i := range 25 {
		id := insert(t, pool, "order", fmt.Sprintf("o-%d", i))
		switch i % 5 {
		case 0:
			exec(t, pool, toPublished, id) // published just now
			keep[id] = "new published"
		case 1:
			exec(t, pool, ageOld, id)
			keep[id] = "old pending"
		case 2:
			exec(t, pool, toPublishing, id)
			exec(t, pool, ageOld, id)
			keep[id] = "old publishing"
		case 3:
			exec(t, pool, toDead, id)
			exec(t, pool, ageOld, id)
			keep[id] = "old dead"
		}
		// Old published rows: 1 of every 5 above plus 20 more, 25 in all.
		if i%5 == 4 {
			old = append(old, id)
		}
	}
	for i := range 20 {
		old = append(old, insert(t, pool, "order", fmt.Sprintf("p-%d", i)))
	}
	for _, id := range old {
		exec(t, pool, toPublished, id)
		exec(t, pool, `UPDATE outbox_messages SET published_at = now() - interval '2 hours', created_at = now() - interval '2 hours'
			WHERE id = $1`, id)
	}

	var seen []admin.CleanupResult
	res, err := admin.Cleanup(ctx, pool, admin.CleanupOptions{
		OlderThan: time.Hour, BatchSize: 10, OnBatch: func(r admin.CleanupResult) { seen = append(seen, r) },
	})
	if err != nil || res.Deleted != 25 || res.Batches != 3 {
		t.Fatalf("Cleanup = %+v, %v; want 25 rows deleted in 3 batches (10, 10, 5)", res, err)
	}
	if len(seen) != 3 || seen[0].Deleted != 10 || seen[1].Deleted != 20 {
		t.Fatalf("batches seen %+v: want running totals 10, 20, 25", seen)
	}
	if d := time.Since(res.Cutoff); d < time.Hour-time.Minute || d > time.Hour+time.Minute {
		t.Fatalf("cutoff %s is %s ago, want about an hour", res.Cutoff, d)
	}
	left := rows(t, pool)
	if len(left) != len(keep) {
		t.Errorf("%d rows left, want %d", len(left), len(keep))
	}
	for id, what := range keep {
		if _, ok := left[id]; !ok {
			t.Errorf("%s row %s was deleted", what, id)
		}
	}

	// Nothing left to delete: one batch that deletes nothing.
	if res, err := admin.Cleanup(ctx, pool, admin.CleanupOptions{OlderThan: time.Hour, BatchSize: 10}); err != nil || res.Deleted != 0 || res.Batches != 1 {
		t.Fatalf("second Cleanup = %+v, %v; want nothing deleted", res, err)
	}
	// A shorter age makes the recently published rows old enough.
	time.Sleep(20 * time.Millisecond)
	if res, err := admin.Cleanup(ctx, pool, admin.CleanupOptions{OlderThan: 10 * time.Millisecond}); err != nil || res.Deleted != 5 {
		t.Fatalf("Cleanup(10ms) = %+v, %v; want the 5 recently published rows", res, err)
	}
	if _, err := admin.Cleanup(ctx, pool, admin.CleanupOptions{}); err == nil {
		t.Fatal("Cleanup without an age: want an error")
	}
}

// A row locked by someone else is skipped, not waited for.
func TestCleanupSkipsLockedRows(t *testing.T) {
	ctx := context.Background()
	pool := outboxtest.Postgres(t)
	var ids []uuid.UUID
	for i := range 5 {
		id := insert(t, pool, "order", fmt.Sprintf("o-%d", i))
		exec(t, pool, toPublished, id)
		exec(t, pool, `UPDATE outbox_messages SET published_at = now() - interval '2 hours' WHERE id = $1`, id)
		ids = append(ids, id)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, "SELECT 1 FROM outbox_messages WHERE id = $1 FOR UPDATE", ids[2]); err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	res, err := admin.Cleanup(cctx, pool, admin.CleanupOptions{OlderThan: time.Hour, BatchSize: 2})
	if err != nil || res.Deleted != 4 {
		t.Fatalf("Cleanup with one row locked = %+v, %v; want the 4 others deleted without waiting", res, err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if res, err := admin.Cleanup(ctx, pool, admin.CleanupOptions{OlderThan: time.Hour}); err != nil || res.Deleted != 1 {
		t.Fatalf("Cleanup after the lock is gone = %+v, %v; want the last row", res, err)
	}
}

// Cleanup running in a loop, with the shortest age, while TEDs are settled
// and a relay publishes them: every event still reaches the stream once, and
// at the end only published rows have been deleted.
func TestCleanupIsSafeWhileARelayRuns(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pool := outboxtest.Postgres(t)
	rdb := outboxtest.NewRedis(t)
	streamPrefix := rdb.Prefix + "outbox.event."
	b, err := redisbroker.New(rdb.Client, redisbroker.Config{})
	if err != nil {
		t.Fatal(err)
	}
	r, err := relay.New(pool, b, relay.Config{Name: "r1", StreamPrefix: streamPrefix, PollInterval: 50 * time.Millisecond, BatchSize: 20})
	if err != nil {
		t.Fatal(err)
	}
	relayDone := make(chan error, 1)
	go func() { relayDone <- r.Run(ctx) }()

	const teds = 300
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			for i := range teds / 4 {
				_, err := transfer.Settle(ctx, pool, transfer.Transfer{
					ID: uuid.New(), FromAccount: fmt.Sprintf("a-%d", w), ToAccount: fmt.Sprintf("b-%d", i%3), AmountCents: 100,
				})
				if err != nil {
					t.Errorf("settle: %v", err)
					return
				}
			}
		})
	}
	settled := make(chan struct{})
	go func() { wg.Wait(); close(settled) }()
	var deleted int64
	for running := true; running; {
		select {
		case <-settled:
			running = false
		default:
		}
		res, err := admin.Cleanup(ctx, pool, admin.CleanupOptions{OlderThan: time.Microsecond, BatchSize: 7})
		if err != nil {
			t.Fatal(err)
		}
		deleted += res.Deleted
	}
	outboxtest.Eventually(t, 20*time.Second, func() bool {
		var unpublished int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox_messages WHERE status <> 'published'").Scan(&unpublished); err != nil {
			t.Fatal(err)
		}
		n, _ := rdb.XLen(ctx, streamPrefix+"transfer").Result()
		return unpublished == 0 && n >= teds
	}, "not every settled TED was published: an unpublished row was deleted?")
	res, err := admin.Cleanup(ctx, pool, admin.CleanupOptions{OlderThan: time.Microsecond, BatchSize: 7})
	if err != nil {
		t.Fatal(err)
	}
	deleted += res.Deleted
	cancel()
	if err := <-relayDone; err != nil {
		t.Fatal(err)
	}

	msgs, err := rdb.XRange(context.Background(), streamPrefix+"transfer", "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	ids := map[string]bool{}
	for _, m := range msgs {
		ids[m.Values["event_id"].(string)] = true
	}
	var left, transfers int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM outbox_messages").Scan(&left); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM transfers").Scan(&transfers); err != nil {
		t.Fatal(err)
	}
	if transfers != teds || len(ids) != teds || left != 0 || deleted != teds {
		t.Fatalf("%d transfers, %d distinct events in the stream, %d rows left, %d deleted; want %d, %d, 0, %d",
			transfers, len(ids), left, deleted, teds, teds, teds)
	}
	t.Logf("%d rows deleted while the relay ran; %d stream entries", deleted, len(msgs))
}
