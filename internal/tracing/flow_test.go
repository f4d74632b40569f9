package tracing_test

import (
	"testing"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/relaytest"
	"github.com/tedbank/outbox/transfer"
)

// The end-to-end trace test sets the process's tracer provider (OpenTelemetry
// keeps one per process), so it runs in a test binary of its own: here,
// rather than beside the module root's end-to-end tests, whose package
// services import (a service's go mod tidy loads that package's tests, and
// the SDK with them).
func TestMain(m *testing.M) { outboxtest.Main(m) }

// A trace started around Settle is continued by the relay's publish span and
// by anti-fraud's process span: one trace from the request to the verdict.
func TestTraceFlowsFromSettleToAntiFraud(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	otel.SetTracerProvider(tp)
	defer func() { _ = tp.Shutdown(t.Context()) }() // later tests get non-recording spans

	f := relaytest.New(t)
	ctx, root := tp.Tracer("test").Start(f.Ctx, "http.request")
	res, err := transfer.Settle(ctx, f.Pool, transfer.Transfer{ID: uuid.New(), FromAccount: "a", ToAccount: "b", AmountCents: 10})
	root.End()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := relaytest.DrainBatch(f.Ctx, f.NewRelay(f.RelayConfig("r1"), nil)); err != nil {
		t.Fatal(err)
	}
	keys := f.Redis.Prefix + "fraud:"
	c, err := fraud.New(f.Redis.Client, fraud.Config{Config: consumer.Config{Stream: f.Stream(), KeyPrefix: keys, Consumer: "c1",
		Block: 100 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	f.Run(c.Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		rep, err := fraud.ReadReport(f.Ctx, f.Redis.Client, fraud.Keys{Prefix: keys})
		return err == nil && rep.Verdicts == 1
	}, "event not processed")

	// Span names follow OpenTelemetry's messaging conventions:
	// "send <destination>", "process <destination>".
	stream := f.Stream()
	byName := map[string]tracetest.SpanStub{}
	outboxtest.Eventually(t, 5*time.Second, func() bool {
		for _, s := range exp.GetSpans() {
			byName[s.Name] = s
		}
		_, ok := byName["process "+stream]
		return ok
	}, "no %q span", "process "+stream)
	settle, publish, process := byName["transfer.settle"], byName["send "+stream], byName["process "+stream]
	traceID := root.SpanContext().TraceID()
	for _, s := range []tracetest.SpanStub{settle, publish, process} {
		if s.SpanContext.TraceID() != traceID {
			t.Fatalf("span %q in trace %s, want the request's trace %s", s.Name, s.SpanContext.TraceID(), traceID)
		}
	}
	if settle.Parent.SpanID() != root.SpanContext().SpanID() ||
		publish.Parent.SpanID() != settle.SpanContext.SpanID() ||
		process.Parent.SpanID() != publish.SpanContext.SpanID() {
		t.Fatalf("span chain broken: settle←%s publish←%s process←%s", settle.Parent.SpanID(), publish.Parent.SpanID(), process.Parent.SpanID())
	}
	attrs := func(s tracetest.SpanStub) map[string]string {
		m := map[string]string{}
		for _, a := range s.Attributes {
			m[string(a.Key)] = a.Value.Emit()
		}
		return m
	}
	pa, ca := attrs(publish), attrs(process)
	for _, want := range []struct{ span, key, value string }{
		{"send", "messaging.system", "redis"}, {"send", "messaging.destination.name", stream},
		{"send", "messaging.operation.type", "send"}, {"send", "messaging.message.id", res.EventID.String()},
		{"process", "messaging.system", "redis"}, {"process", "messaging.destination.name", stream},
		{"process", "messaging.operation.type", "process"}, {"process", "messaging.message.id", res.EventID.String()},
		{"process", "messaging.consumer.group.name", "fraud"},
	} {
		got := pa
		if want.span == "process" {
			got = ca
		}
		if got[want.key] != want.value {
			t.Errorf("%s span: %s = %q, want %q", want.span, want.key, got[want.key], want.value)
		}
	}
}
