package fraud

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/internal/consumertest"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/relaytest"
)

// A review is counted (outbox_fraud_events_processed_total{verdict="review"})
// and logged at DEBUG only: at INFO a burst of reviews no longer floods the
// log (5,589 of 5,593 lines of one run were reviews).
func TestReviewIsCountedAndLoggedAtDebug(t *testing.T) {
	t.Parallel()
	for _, level := range []slog.Level{slog.LevelInfo, slog.LevelDebug} {
		rdb := outboxtest.NewRedis(t)
		ctx := context.Background()
		var logs relaytest.SyncBuffer
		reg := prometheus.NewRegistry()
		metrics := NewMetrics(reg)
		stream := rdb.Prefix + "outbox.event.transfer"
		c, err := New(rdb.Client, Config{Config: consumer.Config{Stream: stream, KeyPrefix: rdb.Prefix + "fraud:", Consumer: "c1",
			Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: level})), Metrics: metrics},
			AmountLimitCents: 50_000, WindowLimitCents: 100_000, Window: time.Hour})
		if err != nil {
			t.Fatal(err)
		}
		if err := c.EnsureGroup(ctx); err != nil {
			t.Fatal(err)
		}
		publish(t, rdb, stream, "bia", 60_000, time.Now().UTC()) // above the amount limit
		if _, err := consumertest.ReadNew(ctx, c.Consumer); err != nil {
			t.Fatal(err)
		}
		if got := counted(t, reg, "outbox_fraud_events_processed_total", "verdict", "review"); got != 1 {
			t.Errorf("level %s: %v reviews counted, want 1", level, got)
		}
		logged := strings.Contains(string(logs.Bytes()), "transfer sent to review")
		if logged != (level == slog.LevelDebug) {
			t.Errorf("level %s: review logged %v, want it only at DEBUG; log:\n%s", level, logged, logs.Bytes())
		}
	}
}

// counted is the value of counter name with label = value in reg.
func counted(t *testing.T, reg *prometheus.Registry, name, label, value string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == value {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}
