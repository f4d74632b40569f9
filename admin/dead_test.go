package admin_test

import (
	"context"
	"github.com/tedbank/outbox/internal/relaytest"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/admin"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/relay/redisbroker"
)

// insert writes a pending outbox row and returns its id.
func insert(t *testing.T, pool *pgxpool.Pool, aggType, aggID string) uuid.UUID {
	t.Helper()
	var id uuid.UUID
	err := pool.QueryRow(context.Background(), `INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload)
		VALUES ($1, $2, 'test.happened', '{"n": 1}') RETURNING id`, aggType, aggID).Scan(&id)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// Statements that put a row in each status, as the relay leaves it.
const (
	toPublishing = `UPDATE outbox_messages SET status = 'publishing', claim_token = gen_random_uuid(),
		claimed_at = now(), claimed_by = 'other-relay' WHERE id = $1`
	toPublished = `UPDATE outbox_messages SET status = 'published', published_at = now(), stream_id = '1-0',
		claimed_at = now(), claimed_by = 'other-relay' WHERE id = $1`
	toDead = `UPDATE outbox_messages SET status = 'dead', attempts = 7, last_error = 'WRONGTYPE boom',
		claimed_at = now(), claimed_by = 'other-relay', next_attempt_at = now() + interval '1 hour' WHERE id = $1`
	// Not claimable for an hour, so a relay's drain leaves it alone.
	toPendingLater = `UPDATE outbox_messages SET attempts = 2, last_error = 'earlier failure',
		next_attempt_at = now() + interval '1 hour' WHERE id = $1`
)

func exec(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// rows returns every outbox row, whole, as JSON text keyed by id.
func rows(t *testing.T, pool *pgxpool.Pool) map[uuid.UUID]string {
	t.Helper()
	rs, err := pool.Query(context.Background(), "SELECT id, row_to_json(o)::text FROM outbox_messages o")
	if err != nil {
		t.Fatal(err)
	}
	defer rs.Close()
	out := map[uuid.UUID]string{}
	for rs.Next() {
		var id uuid.UUID
		var row string
		if err := rs.Scan(&id, &row); err != nil {
			t.Fatal(err)
		}
		out[id] = row
	}
	if err := rs.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// unchanged fails t if any row other than except differs from before.
func unchanged(t *testing.T, before, after map[uuid.UUID]string, except ...uuid.UUID) {
	t.Helper()
	for id, row := range before {
		if slices.Contains(except, id) {
			continue
		}
		if after[id] != row {
			t.Errorf("row %s changed:\nbefore %s\nafter  %s", id, row, after[id])
		}
	}
}

type requeued struct {
	status                          string
	attempts                        int
	lastError, claimedBy            *string
	claimedAt                       *time.Time
	claimToken                      *uuid.UUID
	claimableNow                    bool
	publishedAt                     *time.Time
	streamID                        *string
	nextAttemptInFutureBySomeMargin bool
}

func readRow(t *testing.T, pool *pgxpool.Pool, id uuid.UUID) requeued {
	t.Helper()
	var r requeued
	err := pool.QueryRow(context.Background(), `SELECT status, attempts, last_error, claimed_by, claimed_at, claim_token,
			next_attempt_at <= now(), published_at, stream_id, next_attempt_at > now() + interval '1 minute'
		FROM outbox_messages WHERE id = $1`, id).
		Scan(&r.status, &r.attempts, &r.lastError, &r.claimedBy, &r.claimedAt, &r.claimToken,
			&r.claimableNow, &r.publishedAt, &r.streamID, &r.nextAttemptInFutureBySomeMargin)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func checkRequeued(t *testing.T, pool *pgxpool.Pool, id uuid.UUID) {
	t.Helper()
	r := readRow(t, pool, id)
	if r.status != "pending" || r.attempts != 0 || r.lastError != nil || r.claimedBy != nil || r.claimedAt != nil ||
		r.claimToken != nil || !r.claimableNow {
		t.Fatalf("row %s after requeue: %+v; want pending, attempts 0, claimable now, error and claim cleared", id, r)
	}
}

// A dead event named in RetryDead goes back to pending and a relay publishes
// it; rows in every other status named in the same call are left exactly as
// they were, and so is a dead row that was not named.
func TestRetryDeadRequeuesOnlyDeadRowsAndARelayPublishesThem(t *testing.T) {
	ctx := context.Background()
	pool := outboxtest.Postgres(t)
	rdb := outboxtest.NewRedis(t)
	streamPrefix := rdb.Prefix + "outbox.event."

	// Kill an event the real way: its stream key holds a string, so every
	// XADD fails with WRONGTYPE, and one attempt is all it gets. The backoff
	// of an hour means only the requeue can make it claimable again soon.
	if err := rdb.Set(ctx, streamPrefix+"poison", "not a stream", 0).Err(); err != nil {
		t.Fatal(err)
	}
	dead := insert(t, pool, "poison", "p-1")
	b, err := redisbroker.New(rdb.Client, redisbroker.Config{})
	if err != nil {
		t.Fatal(err)
	}
	r, err := relay.New(pool, b, relay.Config{
		Name: "r1", StreamPrefix: streamPrefix, PollInterval: time.Hour,
		MaxAttempts: 1, BackoffBase: time.Hour, BackoffMax: time.Hour,
		Ownership: relay.OwnRows, // the dead row keeps its claim, which the requeue must clear
	})
	if err != nil {
		t.Fatal(err)
	}
	if res, err := relaytest.DrainBatch(ctx, r); err != nil || res.Failed != 1 {
		t.Fatalf("first drain: %+v, %v; want one failure", res, err)
	}
	if got := readRow(t, pool, dead); got.status != "dead" || got.attempts != 1 || got.lastError == nil ||
		got.claimedBy == nil || !got.nextAttemptInFutureBySomeMargin {
		t.Fatalf("poison row %+v: want dead after one attempt, with its error, claim and an hour of backoff", got)
	}

	pending := insert(t, pool, "order", "o-1")
	exec(t, pool, toPendingLater, pending)
	publishing := insert(t, pool, "order", "o-2")
	exec(t, pool, toPublishing, publishing)
	published := insert(t, pool, "order", "o-3")
	exec(t, pool, toPublished, published)
	otherDead := insert(t, pool, "order", "o-4")
	exec(t, pool, toDead, otherDead)
	unknown := uuid.New()
	before := rows(t, pool)

	// The cause is fixed: the stream key is free again.
	if err := rdb.Del(ctx, streamPrefix+"poison").Err(); err != nil {
		t.Fatal(err)
	}
	res, err := admin.RetryDead(ctx, pool, []uuid.UUID{dead, pending, publishing, published, unknown, dead})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(res.Requeued, []uuid.UUID{dead}) {
		t.Fatalf("requeued %v, want only %s", res.Requeued, dead)
	}
	wantSkipped := []admin.NotRequeued{
		{EventID: pending, Status: "pending"}, {EventID: publishing, Status: "publishing"},
		{EventID: published, Status: "published"}, {EventID: unknown},
	}
	if !slices.Equal(res.Skipped, wantSkipped) {
		t.Fatalf("skipped %+v, want %+v", res.Skipped, wantSkipped)
	}
	unchanged(t, before, rows(t, pool), dead)
	checkRequeued(t, pool, dead)

	// A relay now publishes it, at once.
	br, err := relaytest.DrainBatch(ctx, r)
	if err != nil || br.Published != 1 {
		t.Fatalf("drain after requeue: %+v, %v; want the requeued event published", br, err)
	}
	msgs, err := rdb.XRange(ctx, streamPrefix+"poison", "-", "+").Result()
	if err != nil || len(msgs) != 1 || msgs[0].Values["event_id"] != dead.String() {
		t.Fatalf("stream holds %v (err %v), want the requeued event", msgs, err)
	}
	if got := readRow(t, pool, dead); got.status != "published" {
		t.Fatalf("requeued row is %s after the drain, want published", got.status)
	}

	// Once published it is no longer dead: a second retry leaves it alone.
	res, err = admin.RetryDead(ctx, pool, []uuid.UUID{dead})
	if err != nil || len(res.Requeued) != 0 || !slices.Equal(res.Skipped, []admin.NotRequeued{{EventID: dead, Status: "published"}}) {
		t.Fatalf("second retry: %+v, %v; want it skipped as published", res, err)
	}
}

// RetryAllDead requeues every dead row, in batches, and nothing else.
func TestRetryAllDeadRequeuesEveryDeadRowAndNothingElse(t *testing.T) {
	ctx := context.Background()
	pool := outboxtest.Postgres(t)
	var deads []uuid.UUID
	for i := range 20 { // an exact multiple of the batch: the last batch is empty
		id := insert(t, pool, "order", "o-"+string(rune('a'+i%5)))
		exec(t, pool, toDead, id)
		deads = append(deads, id)
	}
	pending := insert(t, pool, "order", "x-1")
	exec(t, pool, toPendingLater, pending)
	publishing := insert(t, pool, "order", "x-2")
	exec(t, pool, toPublishing, publishing)
	published := insert(t, pool, "order", "x-3")
	exec(t, pool, toPublished, published)
	before := rows(t, pool)

	n, err := admin.RetryAllDead(ctx, pool, 10)
	if err != nil || n != 20 {
		t.Fatalf("RetryAllDead = %d, %v; want 20", n, err)
	}
	for _, id := range deads {
		checkRequeued(t, pool, id)
	}
	unchanged(t, before, rows(t, pool), deads...)
	if n, err := admin.RetryAllDead(ctx, pool, 10); err != nil || n != 0 {
		t.Fatalf("second RetryAllDead = %d, %v; want 0", n, err)
	}
}

func TestListDead(t *testing.T) {
	ctx := context.Background()
	pool := outboxtest.Postgres(t)
	events, total, err := admin.ListDead(ctx, pool, 10)
	if err != nil || events == nil || len(events) != 0 || total != 0 {
		t.Fatalf("empty outbox: %v, %d, %v; want an empty, non-nil list", events, total, err)
	}
	var deads []uuid.UUID
	for i := range 3 {
		id := insert(t, pool, "order", "o-"+string(rune('a'+i)))
		exec(t, pool, toDead, id)
		deads = append(deads, id)
	}
	exec(t, pool, "UPDATE outbox_messages SET last_error = NULL WHERE id = $1", deads[1])
	insert(t, pool, "order", "pending-one")
	events, total, err = admin.ListDead(ctx, pool, 2)
	if err != nil || total != 3 || len(events) != 2 {
		t.Fatalf("ListDead(2) = %d events of %d, %v; want 2 of 3", len(events), total, err)
	}
	if events[0].EventID != deads[0] || events[1].EventID != deads[1] {
		t.Fatalf("listed %s, %s; want the oldest dead events %s, %s", events[0].EventID, events[1].EventID, deads[0], deads[1])
	}
	e := events[0]
	if e.AggregateType != "order" || e.AggregateID != "o-a" || e.EventType != "test.happened" || e.Attempts != 7 ||
		e.LastError != "WRONGTYPE boom" || time.Since(e.CreatedAt) > time.Minute {
		t.Fatalf("dead event %+v", e)
	}
	if events[1].LastError != "" {
		t.Fatalf("a NULL last_error is listed as %q, want empty", events[1].LastError)
	}
}
