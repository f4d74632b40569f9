// Package deps_test checks the dependency rules between the project's
// packages (go list: each package's transitive imports, tests excluded), so
// that a consumer of the event contract links neither the relay nor
// PostgreSQL, and the layers stay apart as docs/design.md draws them.
package deps_test

import (
	"os/exec"
	"slices"
	"strings"
	"testing"
)

const module = "github.com/tedbank/outbox"

// projectDeps returns, for every package of the module (named relative to
// it: "" for the root), the module's packages it imports, directly or not.
func projectDeps(t *testing.T) map[string][]string {
	t.Helper()
	out, err := exec.Command("go", "list", "-f", `{{.ImportPath}} {{join .Deps " "}}`, module+"/...").Output()
	if err != nil {
		var stderr string
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		t.Fatalf("go list: %v\n%s", err, stderr)
	}
	rel := func(p string) (string, bool) {
		if p == module {
			return "", true
		}
		r, ok := strings.CutPrefix(p, module+"/")
		return r, ok
	}
	all := map[string][]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		pkg, _ := rel(f[0])
		all[pkg] = []string{}
		for _, d := range f[1:] {
			if r, ok := rel(d); ok {
				all[pkg] = append(all[pkg], r)
			}
		}
	}
	return all
}

func TestDependencyRules(t *testing.T) {
	all := projectDeps(t)
	for _, r := range []struct{ pkg, never, why string }{
		{"relay", "fraud", "the relay publishes any event; it knows no consumer"},
		{"fraud", "relay", "a consumer reads the stream's wire format (relay/entry), not the relay"},
		{"transfer", "relay", "writers write the outbox; publishing is the relay's"},
		{"relay", "transfer", "the relay publishes any event type"},
		{"fraud", "transfer", "a consumer needs the event contract (transfer/settled), not the writer and its driver"},
		{"consumer", "relay", "the consumer package reads the stream's wire format (relay/entry), not the relay"},
		{"consumer", "transfer", "the consumer package consumes any event type"},
		{"consumer", "fraud", "anti-fraud is one user of the consumer package, not part of it"},
	} {
		deps, ok := all[r.pkg]
		if !ok {
			t.Fatalf("go list did not list %s", r.pkg)
		}
		if slices.Contains(deps, r.never) {
			t.Errorf("%s imports %s (directly or not): %s", r.pkg, r.never, r.why)
		}
	}
	// The contracts are leaves: a consumer in another repository links them
	// and nothing else of this one.
	for _, leaf := range []string{"transfer/settled", "relay/entry", "partition", "consumer/source"} {
		if deps, ok := all[leaf]; !ok || len(deps) > 0 {
			t.Errorf("%s imports %v (listed: %v): it must import nothing of the project", leaf, deps, ok)
		}
	}
	// No library package depends on the command.
	for pkg, deps := range all {
		if pkg == "internal/cli" || strings.HasPrefix(pkg, "cmd/") {
			continue
		}
		for _, d := range deps {
			if d == "internal/cli" || strings.HasPrefix(d, "cmd/") {
				t.Errorf("%q imports %s: library packages must not depend on the command", pkg, d)
			}
		}
	}
}

// The library packages, which a team imports into its services, link no
// OpenTelemetry SDK or exporter, no gRPC and no Docker client: the
// commands install the exporter (internal/traceexport) and the tests start
// the servers. The OpenTelemetry API (for spans a service's provider
// records) and the Prometheus client stay.
func TestLibraryFootprint(t *testing.T) {
	library := []string{"", "transfer", "relay", "relay/broker", "relay/redisbroker", "relay/natsbroker",
		"consumer", "consumer/source", "consumer/natssource", "consumer/inbox", "fraud", "ledger",
		"partition", "relay/entry", "transfer/settled", "admin", "admin/dlq", "reconcile"}
	// Only the NATS broker and source link the NATS client: a team on Redis
	// does not.
	noNATS := []string{"", "transfer", "relay", "relay/broker", "relay/redisbroker",
		"consumer", "consumer/source", "consumer/inbox", "fraud", "ledger", "admin", "admin/dlq", "reconcile"}
	// The relay knows brokers by their seam (relay/broker): a service on
	// NATS links no Redis client.
	noRedis := []string{"relay", "relay/broker", "relay/natsbroker", "relay/entry", "partition", "transfer", "transfer/settled"}
	forbidden := []struct{ prefix, why string }{
		{"go.opentelemetry.io/otel/sdk", "the OpenTelemetry SDK is the service's choice"},
		{"go.opentelemetry.io/otel/exporters", "exporters are set up by the command (internal/traceexport)"},
		{"google.golang.org/grpc", "gRPC comes only with the OTLP gRPC exporter"},
		{"github.com/testcontainers", "test servers are the tests'"},
		{"github.com/docker", "test servers are the tests'"},
		{"github.com/moby", "test servers are the tests'"},
		{module + "/internal/traceexport", "exporters are set up by the command"},
		{module + "/internal/testenv", "test servers are the tests'"},
	}
	// One go list: each package's transitive imports, the standard
	// library's among them (skipped: none has a dot in its first element).
	pkgs := make([]string, len(library))
	for i, pkg := range library {
		pkgs[i] = module
		if pkg != "" {
			pkgs[i] += "/" + pkg
		}
	}
	out, err := exec.Command("go", append([]string{"list", "-f", `{{.ImportPath}} {{join .Deps " "}}`}, pkgs...)...).Output()
	if err != nil {
		t.Fatalf("go list %v: %v", pkgs, err)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) != len(pkgs) {
		t.Fatalf("go list listed %d packages, want %d", len(lines), len(pkgs))
	}
	for _, line := range lines {
		f := strings.Fields(line)
		rel := strings.TrimPrefix(strings.TrimPrefix(f[0], module), "/")
		natsFree, redisFree := slices.Contains(noNATS, rel), slices.Contains(noRedis, rel)
		for _, d := range f[1:] {
			if natsFree && strings.HasPrefix(d, "github.com/nats-io/") {
				t.Errorf("%s links %s: only relay/natsbroker and consumer/natssource link the NATS client", f[0], d)
			}
			if redisFree && strings.HasPrefix(d, "github.com/redis/") {
				t.Errorf("%s links %s: the relay reaches Redis only through relay/redisbroker", f[0], d)
			}
			for _, bad := range forbidden {
				if strings.HasPrefix(d, bad.prefix) {
					t.Errorf("%s links %s: %s", f[0], d, bad.why)
					break
				}
			}
		}
	}
}

// A service's go mod tidy loads the tests of the packages it imports: the
// library packages' tests must not link the command (and with it the OTLP
// exporters and gRPC) or the OpenTelemetry SDK, so that tidy fetches them
// not. What remains is testcontainers, for the module root's end-to-end
// tests (relay_test.go finds its servers through Docker when it can):
// docs/development.md, "What a service downloads".
func TestLibraryTestsFootprint(t *testing.T) {
	library := []string{module, module + "/relay", module + "/consumer", module + "/transfer", module + "/fraud"}
	out, err := exec.Command("go", append([]string{"list", "-test", "-deps"}, library...)...).Output()
	if err != nil {
		t.Fatalf("go list -test -deps: %v", err)
	}
	forbidden := []struct{ prefix, why string }{
		{module + "/internal/cli", "the command: read its JSON by field names instead"},
		{module + "/internal/traceexport", "the command's exporters"},
		{"go.opentelemetry.io/otel/sdk", "the SDK: the end-to-end trace test lives in internal/tracing"},
		{"go.opentelemetry.io/otel/exporters", "exporters are the command's"},
		{"google.golang.org/grpc", "gRPC comes only with the OTLP gRPC exporter"},
	}
	for _, d := range strings.Fields(string(out)) {
		for _, bad := range forbidden {
			if strings.HasPrefix(d, bad.prefix) {
				t.Errorf("the tests of %v link %s: %s", library, d, bad.why)
			}
		}
	}
}
