package outbox_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tedbank/outbox/internal/connect"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/reconcile"
)

// Redis loses entries it had acknowledged (restarted without its
// append-only file: here the test's streams and anti-fraud's keys are
// deleted under a running relay). reconcile reports the 30 TEDs lost;
// outbox republish puts exactly those back to pending, fenced (only
// published rows; a second run republishes none while they wait) and
// audited (who, when, why, the entry they had); the relay publishes them
// again and anti-fraud judges each once.
func TestLostEventsAreRepublishedAndAppliedOnce(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	stopRelay := f.Run(f.NewRelay(f.RelayConfig("relay"), nil).Run)
	stopConsumer := f.Run(f.consumer("c1", nil).Run)
	teds := f.Settle(30)
	outboxtest.Eventually(t, 20*time.Second, func() bool { return f.report().Verdicts == 30 }, "the TEDs were not judged")
	stopConsumer()
	stopRelay() // back after the repair, so that the second run below finds the rows pending

	// The loss: the stream and anti-fraud's state, markers included.
	if err := connect.DeleteKeys(f.Ctx, f.Redis.Client, f.Redis.Prefix+"*"); err != nil {
		t.Fatal(err)
	}
	rep, err := reconcile.Run(f.Ctx, f.Pool, f.Redis.Client, reconcile.Options{
		Since: time.Now().Add(-time.Hour), Grace: time.Nanosecond, Stream: f.Stream(), KeyPrefix: f.keyPrefix(), ListLost: true})
	if err != nil {
		t.Fatal(err)
	}
	if rep.NotInStream.Count != 30 || len(rep.Lost) != 30 {
		t.Fatalf("reconcile: %d not in the stream, %d listed; want 30 and 30", rep.NotInStream.Count, len(rep.Lost))
	}
	report := filepath.Join(t.TempDir(), "lost.json")
	b, _ := json.Marshal(rep)
	if err := os.WriteFile(report, b, 0o600); err != nil {
		t.Fatal(err)
	}

	republish := func() (string, error) {
		out, err := f.OutboxCmd("", "republish", "--report", report, "--by", "ops@test", "--reason", "redis restarted without its AOF").CombinedOutput()
		return string(out), err
	}
	out, err := republish()
	if err != nil || !strings.Contains(out, "republished 30 events") {
		t.Fatalf("outbox republish: %v\n%s", err, out)
	}
	// Fenced: pending now, they are not republished (nor audited) again.
	if out, err := republish(); err == nil || !strings.Contains(out, "republished 0 events") ||
		!strings.Contains(out, "30 of 30 events not republished") || !strings.Contains(out, "is pending, not published") {
		t.Fatalf("outbox republish a second time: %v, want every event skipped as pending\n%s", err, out)
	}
	f.Run(f.NewRelay(f.RelayConfig("relay"), nil).Run)
	f.Run(f.consumer("c1", nil).Run)
	outboxtest.Eventually(t, 20*time.Second, func() bool { return f.report().Verdicts == 30 }, "the republished TEDs were not judged")
	f.checkEffectsOnce(teds)
	if n := f.Count(`SELECT count(*) FROM outbox_republished
		WHERE republished_by = 'ops@test' AND reason = 'redis restarted without its AOF'
		  AND previous_stream_id IS NOT NULL AND previous_published_at IS NOT NULL`); n != 30 {
		t.Fatalf("%d audit rows, want 30", n)
	}
	// A relay marks a batch published after its publish (a partition owner
	// in its next round trip): anti-fraud may judge the events first.
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 30
	}, "the 30 events were not all marked published after the repair")
}
