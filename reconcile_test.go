package outbox_test

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/tedbank/outbox/admin"
	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/reconcile"
)

// outbox reconcile finds, after a clean run, nothing; then each planted
// difference, and only it: a transfer without its event, an event left
// pending, a stream entry deleted before anti-fraud read it, an entry
// anti-fraud has not read yet, and a sender's total changed behind its back.
func TestReconcileFindsWhatWasPlanted(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	r := f.NewRelay(f.RelayConfig("r1"), nil)
	stopRelay := f.Run(r.Run)
	c := f.consumer("c1", nil)
	stopConsumer := f.Run(c.Run)
	teds := f.Settle(30)
	// Marked published in PostgreSQL too: a batch's mark (and its
	// stream_id) rides the relay's next round trip, after the XADD that
	// anti-fraud may already have read.
	published := func(n int) {
		t.Helper()
		outboxtest.Eventually(t, 10*time.Second, func() bool {
			return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == n
		}, "%d events not marked published", n)
	}
	outboxtest.Eventually(t, 10*time.Second, func() bool { return f.report().Verdicts == int64(len(teds)) },
		"anti-fraud never judged the %d TEDs", len(teds))
	published(30)

	later := time.Now().Add(2 * time.Minute) // every event past the grace period
	opt := reconcile.Options{Since: time.Now().Add(-time.Hour), Stream: f.Stream(), KeyPrefix: f.keyPrefix(), Now: later}
	rep, err := reconcile.Run(f.Ctx, f.Pool, f.Redis.Client, opt)
	if err != nil {
		t.Fatal(err)
	}
	if !rep.OK || rep.Transfers != 30 || rep.Events != 30 || rep.Senders != 30 {
		t.Fatalf("clean run: %+v, want OK with 30 transfers, 30 events, 30 senders", rep)
	}

	// Anti-fraud stops; two more TEDs are published; one entry is deleted
	// before anti-fraud could read it.
	stopConsumer()
	behind := f.Settle(2)
	published(32)
	var deletedEvent, behindEvent string
	for _, tr := range behind {
		var id, sid string
		if err := f.Pool.QueryRow(f.Ctx, "SELECT id::text, stream_id FROM outbox_messages WHERE aggregate_id = $1", tr.ID.String()).Scan(&id, &sid); err != nil {
			t.Fatal(err)
		}
		if deletedEvent == "" {
			deletedEvent = id
			if err := f.Redis.XDel(f.Ctx, f.Stream(), sid).Err(); err != nil {
				t.Fatal(err)
			}
		} else {
			behindEvent = id
		}
	}
	// The relay stops; one more TED stays pending.
	stopRelay()
	pendingTED := f.Settle(1)[0]
	var pendingEvent string
	if err := f.Pool.QueryRow(f.Ctx, "SELECT id::text FROM outbox_messages WHERE aggregate_id = $1", pendingTED.ID.String()).Scan(&pendingEvent); err != nil {
		t.Fatal(err)
	}
	// A transfer written without its event (what the outbox forbids).
	lone := uuid.New()
	f.Exec("INSERT INTO transfers (id, from_account, to_account, amount_cents) VALUES ($1, 'acct-lone', 'acct-00', 500)", lone)
	// A sender's total changed behind anti-fraud's back.
	var settledAt time.Time
	if err := f.Pool.QueryRow(f.Ctx, "SELECT settled_at FROM transfers WHERE from_account = 'acct-003' LIMIT 1").Scan(&settledAt); err != nil {
		t.Fatal(err)
	}
	day, _ := fraud.Day(settledAt)
	if err := f.Redis.HIncrBy(f.Ctx, fraud.Keys{Prefix: f.keyPrefix()}.DayAccount(day, "acct-003"), "sent_cents", 1).Err(); err != nil {
		t.Fatal(err)
	}

	rep, err = reconcile.Run(f.Ctx, f.Pool, f.Redis.Client, opt)
	if err != nil {
		t.Fatal(err)
	}
	check := func(name string, d reconcile.Diff, want ...string) {
		t.Helper()
		if d.Count != len(want) || fmt.Sprint(d.Examples) != fmt.Sprint(want) {
			t.Errorf("%s: %d %v, want %v", name, d.Count, d.Examples, want)
		}
	}
	check("missing_event", rep.MissingEvent, lone.String())
	check("unpublished", rep.Unpublished, pendingEvent)
	check("not_in_stream", rep.NotInStream, deletedEvent)
	check("no_verdict", rep.NoVerdict, behindEvent)
	check("orphan_event", rep.Orphan)
	if rep.TotalsDiffer != 1 || rep.SenderDiffs[0].Account != "acct-003" || rep.SenderDiffs[0].FraudCents != rep.SenderDiffs[0].WantCents+1 {
		t.Errorf("totals: %d differ %+v, want acct-003 one cent over", rep.TotalsDiffer, rep.SenderDiffs)
	}
	if rep.OK {
		t.Error("report OK with differences planted")
	}

	// Within the grace period, the pending and unread events are not (yet)
	// differences; the missing event and the wrong total are.
	opt.Now = time.Now()
	rep, err = reconcile.Run(f.Ctx, f.Pool, f.Redis.Client, opt)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Unpublished.Count != 0 || rep.NoVerdict.Count != 0 || rep.NotInStream.Count != 0 || rep.MissingEvent.Count != 1 || rep.TotalsDiffer != 1 {
		t.Errorf("within the grace period: %+v", rep)
	}
}

// After outbox cleanup deleted published events, reconcile counts their
// judged transfers as cleaned up, not as a writer that bypassed
// transfer.Settle; a transfer settled before the cleanup horizon with no
// verdict, and one settled after it without its event, are still missing.
func TestReconcileAfterCleanupIsNotABypass(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.Run(f.NewRelay(f.RelayConfig("r1"), nil).Run)
	f.Run(f.consumer("c1", nil).Run)
	teds := f.Settle(10)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.report().Verdicts == int64(len(teds)) && f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == len(teds)
	}, "the 10 TEDs were not published and judged")
	// A transfer settled then, whose event never reached anti-fraud (written
	// without it, as a bypass would): cleanup cannot explain it.
	early := uuid.New()
	f.Exec("INSERT INTO transfers (id, from_account, to_account, amount_cents, settled_at) VALUES ($1, 'acct-early', 'acct-00', 700, now() - interval '1 minute')", early)

	res, err := admin.Cleanup(f.Ctx, f.Pool, admin.CleanupOptions{OlderThan: time.Microsecond})
	if err != nil || res.Deleted != 10 {
		t.Fatalf("cleanup: %+v %v, want 10 deleted", res, err)
	}
	var runs int
	if err := f.Pool.QueryRow(f.Ctx, "SELECT count(*) FROM outbox_cleanups WHERE deleted = 10 AND cutoff = $1", res.Cutoff).Scan(&runs); err != nil || runs != 1 {
		t.Fatalf("cleanup runs recorded: %d (err %v), want 1", runs, err)
	}
	// After the horizon: a transfer without its event is a bypass again.
	late := uuid.New()
	f.Exec("INSERT INTO transfers (id, from_account, to_account, amount_cents) VALUES ($1, 'acct-late', 'acct-00', 500)", late)

	opt := reconcile.Options{Since: time.Now().Add(-time.Hour), Stream: f.Stream(), KeyPrefix: f.keyPrefix(), Now: time.Now().Add(2 * time.Minute)}
	rep, err := reconcile.Run(f.Ctx, f.Pool, f.Redis.Client, opt)
	if err != nil {
		t.Fatal(err)
	}
	if rep.CleanedUp != 10 || rep.CleanupHorizon == nil || rep.MissingEvent.Count != 2 ||
		!slices.Contains(rep.MissingEvent.Examples, early.String()) || !slices.Contains(rep.MissingEvent.Examples, late.String()) || rep.TotalsDiffer != 0 {
		t.Fatalf("after cleanup: cleaned up %d (horizon %v), missing %+v, totals differ %d; want 10 cleaned up, the early and late transfers missing",
			rep.CleanedUp, rep.CleanupHorizon, rep.MissingEvent, rep.TotalsDiffer)
	}
}
