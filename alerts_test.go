package outbox_test

import (
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/relay/redisbroker"
)

// alertRules is the shape of a Prometheus rule file, as far as the checks
// below need it.
type alertRules struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []struct {
			Alert       string            `yaml:"alert"`
			Expr        string            `yaml:"expr"`
			For         string            `yaml:"for"`
			Labels      map[string]string `yaml:"labels"`
			Annotations map[string]string `yaml:"annotations"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

// exportedMetrics returns the names of every metric the relay and the
// anti-fraud consumer export.
func exportedMetrics() descNames {
	names := descNames{}
	relay.NewMetrics(names)
	redisbroker.NewMetrics(names)
	fraud.NewMetrics(names)
	consumer.NewMetrics(names, "ledger", "") // the ledger example's, as outbox ledger registers them
	names.MustRegister(relay.NewOutboxCollector(nil), fraud.NewGroupCollector(nil, "s", "g"),
		consumer.NewGroupCollector(nil, "ledger", "s", "g"))
	return names
}

// The alert rules in docs/alerts.yml parse, each has what an on-call needs
// (a summary, a runbook, a severity), and every metric they use is one the
// relay or the consumer exports: a renamed metric must not leave an alert
// that can never fire. With promtool installed (.ci/run installs it), the
// file must also pass `promtool check rules`.
func TestAlertRules(t *testing.T) {
	const path = "docs/alerts.yml"
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var rules alertRules
	if err := yaml.Unmarshal(data, &rules); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	exported := exportedMetrics()
	metricRef := regexp.MustCompile(`\b(outbox_[a-z_]+)`)
	var alerts []string
	used := map[string]bool{}
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			alerts = append(alerts, r.Alert)
			if r.Alert == "" || r.Expr == "" {
				t.Errorf("group %s: a rule without alert or expr: %+v", g.Name, r)
			}
			if r.Annotations["summary"] == "" || r.Annotations["runbook"] == "" || r.Labels["severity"] == "" {
				t.Errorf("%s: needs a summary, a runbook and a severity", r.Alert)
			}
			refs := metricRef.FindAllStringSubmatch(r.Expr, -1)
			if len(refs) == 0 {
				t.Errorf("%s: uses no outbox metric: %s", r.Alert, r.Expr)
			}
			for _, m := range refs {
				name := m[1]
				for _, suffix := range []string{"_bucket", "_sum", "_count"} {
					if base, ok := strings.CutSuffix(name, suffix); ok && exported[base] {
						name = base
					}
				}
				used[name] = true
				if !exported[name] {
					t.Errorf("%s: metric %s is not exported by the relay or the consumer", r.Alert, m[1])
				}
			}
		}
	}
	// What the operations guide promises an alert on.
	for _, want := range []string{"OutboxEventsWaiting", "OutboxBacklogLarge", "OutboxBacklogGrowing",
		"OutboxBatchSlow", "OutboxRepeatedFailures", "OutboxDeadEvents", "OutboxRelayDown", "FraudLagging"} {
		if !slices.Contains(alerts, want) {
			t.Errorf("no %s alert", want)
		}
	}
	for _, m := range []string{"outbox_messages", "outbox_oldest_pending_age_seconds", "outbox_messages_retrying",
		"outbox_relay_batch_duration_seconds", "outbox_fraud_group_lag"} {
		if !used[m] {
			t.Errorf("no alert uses %s", m)
		}
	}

	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Log("promtool not installed: the rules were parsed and their metrics checked, not compiled by Prometheus")
		return
	}
	out, err := exec.Command(promtool, "check", "rules", path).CombinedOutput()
	if err != nil {
		t.Fatalf("promtool check rules %s: %v\n%s", path, err, out)
	}
	t.Logf("promtool: %s", strings.TrimSpace(string(out)))
}
