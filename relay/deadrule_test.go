package relay_test

import (
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/tedbank/outbox"
	"github.com/tedbank/outbox/admin"
	"github.com/tedbank/outbox/internal/outboxtest"
)

// The rule for dead events (docs/design.md, "Dead events"): a dead event
// stops blocking its key, so the key's later events are published without
// it; requeued (outbox dead retry), it is the oldest unpublished event of
// its key again, so it is published next and the key's events written after
// it wait behind it, as behind any pending event.
func TestDeadEventStopsBlockingItsKeyAndARequeuedOneGoesFirst(t *testing.T) {
	f := newFixture(t)
	poison := f.StreamPrefix() + "poison"
	write := func() uuid.UUID {
		t.Helper()
		var id uuid.UUID
		err := pgx.BeginFunc(f.Ctx, f.Pool, func(tx pgx.Tx) error {
			w, err := outbox.Write(f.Ctx, tx, outbox.Message{AggregateType: "poison", AggregateID: "p1", EventType: "x", Payload: []byte(`{}`)})
			if err == nil {
				id = w[0].ID
			}
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	cfg := f.RelayConfig("r1")
	cfg.PollInterval, cfg.MaxAttempts = 20*time.Millisecond, 1

	// e1 dies: its stream is a string key (WRONGTYPE, an error of the event).
	if err := f.Redis.Set(f.Ctx, poison, "not a stream", 0).Err(); err != nil {
		t.Fatal(err)
	}
	e1 := write()
	stop := f.Run(f.NewRelay(cfg, nil).Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE id = $1 AND status = 'dead'", e1) == 1
	}, "e1 never went dead")
	if err := f.Redis.Del(f.Ctx, poison).Err(); err != nil {
		t.Fatal(err)
	}
	// e2 and e3 of the same key are published: the dead e1 holds nothing.
	e2, e3 := write(), write()
	outboxtest.Eventually(t, 10*time.Second, func() bool { return len(f.Entries(poison)) == 2 },
		"the key's later events waited behind its dead event")
	stop()

	// Requeued, e1 goes first: e4, written after the requeue, waits for it.
	if res, err := admin.RetryDead(f.Ctx, f.Pool, []uuid.UUID{e1}); err != nil || len(res.Requeued) != 1 {
		t.Fatalf("dead retry: %+v, %v", res, err)
	}
	e4 := write()
	f.Run(f.NewRelay(cfg, nil).Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return len(f.Entries(poison)) == 4 },
		"the requeued event and the one after it were not both published")
	want := []string{e2.String(), e3.String(), e1.String(), e4.String()}
	if got := f.Entries(poison); !slices.Equal(got, want) {
		t.Fatalf("stream order %v, want e2, e3, e1 (requeued), e4 %v", got, want)
	}
}
