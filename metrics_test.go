package outbox_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/metrics"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/relay"
)

// scrape GETs /metrics and returns the value of a metric (its first series
// matching the label, if given), or -1 when absent.
func scrape(t *testing.T, url, name string, label ...string) float64 {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	fam, ok := fams[name]
	if !ok {
		return -1
	}
	for _, m := range fam.Metric {
		if len(label) == 2 && !hasLabel(m, label[0], label[1]) {
			continue
		}
		switch {
		case m.Gauge != nil:
			return m.Gauge.GetValue()
		case m.Counter != nil:
			return m.Counter.GetValue()
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount())
		}
	}
	return -1
}

func hasLabel(m *dto.Metric, k, v string) bool {
	for _, l := range m.Label {
		if l.GetName() == k && l.GetValue() == v {
			return true
		}
	}
	return false
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// The metrics follow the database: the pending gauge and the oldest-age gauge
// rise while events wait and fall to zero once the relay drains them.
func TestMetricsFollowTheOutbox(t *testing.T) {
	f := newFixture(t)
	reg := metrics.NewRegistry()
	reg.MustRegister(relay.NewOutboxCollector(f.Pool))
	cfg := f.RelayConfig("r1")
	cfg.Metrics = relay.NewMetrics(reg)
	r := f.NewRelay(cfg, nil)
	srv := httptest.NewServer(metrics.Handler(reg, r.Ready))
	defer srv.Close()

	if code, _ := get(t, srv.URL+"/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz %d", code)
	}
	if code, body := get(t, srv.URL+"/readyz"); code != http.StatusServiceUnavailable {
		t.Fatalf("/readyz before the relay runs: %d %s, want 503 (LISTEN down)", code, body)
	}

	f.Settle(7)
	if got := scrape(t, srv.URL, "outbox_messages", "status", "pending"); got != 7 {
		t.Fatalf("pending gauge %v, want 7", got)
	}
	if got := scrape(t, srv.URL, "outbox_messages_retrying"); got != 0 {
		t.Fatalf("retrying gauge %v before any failure, want 0", got)
	}
	// Two rows failed once and wait for their retry (they stay claimable).
	f.Exec("UPDATE outbox_messages SET attempts = 1 WHERE id IN (SELECT id FROM outbox_messages ORDER BY seq LIMIT 2)")
	if got := scrape(t, srv.URL, "outbox_messages_retrying"); got != 2 {
		t.Fatalf("retrying gauge %v, want 2", got)
	}
	age1 := scrape(t, srv.URL, "outbox_oldest_pending_age_seconds")
	time.Sleep(300 * time.Millisecond)
	age2 := scrape(t, srv.URL, "outbox_oldest_pending_age_seconds")
	if age1 <= 0 || age2 < age1+0.25 {
		t.Fatalf("oldest pending age %v then %v: want it positive and growing while events wait", age1, age2)
	}

	f.Run(r.Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return scrape(t, srv.URL, "outbox_messages", "status", "pending") == 0
	}, "pending gauge never dropped to 0")
	if got := scrape(t, srv.URL, "outbox_oldest_pending_age_seconds"); got != 0 {
		t.Fatalf("oldest age %v after the drain, want 0", got)
	}
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return scrape(t, srv.URL, "outbox_messages_retrying") == 0
	}, "retrying gauge never dropped to 0 once the failed rows were published")
	// Claimed rows leave "pending" before their mark commits (it rides with
	// the relay's next claim).
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return scrape(t, srv.URL, "outbox_relay_published_total") == 7
	}, "published_total never reached 7")
	if got := f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'"); got != 7 {
		t.Fatalf("%d published rows", got)
	}
	if got := scrape(t, srv.URL, "outbox_relay_listen_connected"); got != 1 {
		t.Fatalf("listen_connected %v", got)
	}
	wantSlots := 0.0 // row claims hold no slot
	if r.Ownership() == relay.OwnPartitions {
		wantSlots = 16 // the only relay: every slot
	}
	if got := scrape(t, srv.URL, "outbox_relay_partition_slots"); got != wantSlots {
		t.Fatalf("partition_slots %v, want %v", got, wantSlots)
	}
	if got := scrape(t, srv.URL, "outbox_relay_publish_delay_seconds"); got != 7 {
		t.Fatalf("publish delay observations %v, want 7", got)
	}
	if code, body := get(t, srv.URL+"/readyz"); code != http.StatusOK {
		t.Fatalf("/readyz %d %s", code, body)
	}

	// Anti-fraud: processed, duplicates and the group's pending count.
	creg := metrics.NewRegistry()
	c := f.consumer("c1", func(c *fraud.Config) { c.Metrics = fraud.NewMetrics(creg) })
	creg.MustRegister(fraud.NewGroupCollector(f.Redis.Client, f.Stream(), fraud.DefaultGroup))
	csrv := httptest.NewServer(metrics.Handler(creg, c.Ready))
	defer csrv.Close()
	f.Run(c.Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return scrape(t, csrv.URL, "outbox_fraud_events_processed_total", "verdict", "approve") == 7
	}, "processed counter never reached 7")
	if got := scrape(t, csrv.URL, "outbox_fraud_group_pending"); got != 0 {
		t.Fatalf("group pending %v, want 0", got)
	}
}

// descNames records the names of every metric registered with it.
type descNames map[string]bool

var fqName = regexp.MustCompile(`fqName: "([^"]+)"`)

func (d descNames) Register(c prometheus.Collector) error {
	ch := make(chan *prometheus.Desc)
	go func() { c.Describe(ch); close(ch) }()
	for desc := range ch {
		if m := fqName.FindStringSubmatch(desc.String()); m != nil {
			d[m[1]] = true
		}
	}
	return nil
}
func (d descNames) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		_ = d.Register(c)
	}
}
func (d descNames) Unregister(prometheus.Collector) bool { return false }

// The dashboard and the alert rules in docs/ use exactly the metrics the
// code exports: a renamed metric breaks this test, not a production alert.
func TestDocsUseExistingMetrics(t *testing.T) {
	names := exportedMetrics()
	used := regexp.MustCompile(`\boutbox_[a-z_]+`)
	for _, doc := range []string{"docs/grafana-dashboard.json", "docs/operations.md"} {
		b, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		// The dashboard's consumer panels name their metrics after the
		// $consumer variable (outbox_<name>_...): anti-fraud's must exist.
		text := strings.ReplaceAll(string(b), "${consumer}", "fraud")
		found := 0
		for _, name := range used.FindAllString(text, -1) {
			switch {
			case strings.HasPrefix(name, "outbox_messages_"), name == "outbox_schema_migrations",
				name == "outbox_relay_idle", name == "outbox_notify_mode", name == "outbox_relay_partitions", name == "outbox_relay_members",
				name == "outbox_relay_busy_pid", name == "outbox_live_relays",
				name == "outbox_writer", name == "outbox_relay", name == "outbox_admin", name == "outbox_republished",
				name == "outbox_operator_actions", name == "outbox_cleanups":
				continue // table, index, sequence, function and role names, not metrics
			}
			base := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(name, "_bucket"), "_count"), "_sum")
			if !names[base] && !names[name] {
				t.Errorf("%s uses %s, which no code exports", doc, name)
			}
			found++
		}
		if found < 10 {
			t.Errorf("%s: only %d metric references found", doc, found)
		}
	}
}

// A long transaction holding the xmin horizon (a report in REPEATABLE READ,
// a session idle in transaction after a write) keeps every dead index entry
// of the outbox alive, and a backlog drains slower behind it: the
// age of the oldest such transaction is exported, for OutboxHorizonHeld.
func TestOldestTransactionAgeIsExported(t *testing.T) {
	f := newFixture(t)
	reg := metrics.NewRegistry()
	reg.MustRegister(relay.NewOutboxCollector(f.Pool))
	srv := httptest.NewServer(metrics.Handler(reg, func(context.Context) error { return nil }))
	defer srv.Close()
	if got := scrape(t, srv.URL, "outbox_oldest_transaction_age_seconds"); got < 0 || got > 5 {
		t.Fatalf("oldest transaction %vs (-1: not exported) with none open but the scrape's", got)
	}
	long, err := f.Pool.BeginTx(f.Ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	defer long.Rollback(f.Ctx) //nolint:errcheck // the test's end
	if _, err := long.Exec(f.Ctx, "SELECT count(*) FROM outbox_messages"); err != nil {
		t.Fatal(err)
	}
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return scrape(t, srv.URL, "outbox_oldest_transaction_age_seconds") >= 1
	}, "the open transaction's age was not exported")
	if err := long.Rollback(f.Ctx); err != nil {
		t.Fatal(err)
	}
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return scrape(t, srv.URL, "outbox_oldest_transaction_age_seconds") < 1
	}, "the age stayed up after the transaction ended")
}
