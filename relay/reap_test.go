package relay_test

import (
	"github.com/tedbank/outbox/internal/relaytest"
	"testing"
	"time"
)

// The reaper returns claims whose lease expired to pending, counting an
// attempt (an event that keeps killing its relays ends dead), fences the
// relay that held them, pages through more than a batch, and leaves live
// claims alone; the rows it returned are then published.
func TestReapReturnsOnlyExpiredClaims(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.Settle(8)
	// Claims by a relay that vanished: five expired two minutes ago (one
	// of them on its last attempt; well within the redelivery window), three
	// taken just now.
	f.Exec(`UPDATE outbox_messages SET status = 'publishing', claimed_by = 'ghost', claim_token = gen_random_uuid(),
		claimed_at = CASE WHEN seq <= (SELECT min(seq) + 4 FROM outbox_messages) THEN now() - interval '2 minutes' ELSE now() END`)
	f.Exec(`UPDATE outbox_messages SET attempts = 2 WHERE seq = (SELECT min(seq) FROM outbox_messages)`)

	cfg := f.RowsRelayConfig("reaper")
	cfg.Lease, cfg.BatchSize, cfg.MaxAttempts = time.Minute, 2, 3
	r := f.NewRelay(cfg, nil)
	n, err := relaytest.Reap(f.Ctx, r)
	if err != nil {
		t.Fatal(err)
	}
	if n != 5 || r.Stats().Reaped != 5 {
		t.Fatalf("reaped %d (stats %d), want the 5 expired claims", n, r.Stats().Reaped)
	}
	for _, c := range []struct {
		what, query string
		want        int
	}{
		{"returned to pending, fenced, with an attempt and the reason",
			`SELECT count(*) FROM outbox_messages WHERE status = 'pending' AND claim_token IS NULL AND attempts = 1
			   AND last_error = 'lease expired (claimed by ghost)'`, 4},
		{"dead after its last attempt", "SELECT count(*) FROM outbox_messages WHERE status = 'dead' AND attempts = 3", 1},
		{"live claims left alone", "SELECT count(*) FROM outbox_messages WHERE status = 'publishing' AND claim_token IS NOT NULL", 3},
	} {
		if got := f.Count(c.query); got != c.want {
			t.Errorf("%s: %d rows, want %d", c.what, got, c.want)
		}
	}
	if n, err := relaytest.Reap(f.Ctx, r); err != nil || n != 0 {
		t.Fatalf("second reap returned %d (err %v), want 0", n, err)
	}
	if got := f.DrainAll(r); got != 4 {
		t.Fatalf("published %d after the reap, want the 4 returned rows", got)
	}
}
