package outbox_test

import (
	"github.com/tedbank/outbox/internal/relaytest"
	"testing"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/transfer"
)

// A trace started around Settle is continued by the relay's publish span and
// by anti-fraud's process span: one trace from the request to the verdict.
func TestTraceFlowsFromSettleToAntiFraud(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	otel.SetTracerProvider(tp)
	defer func() { _ = tp.Shutdown(t.Context()) }() // later tests get non-recording spans

	f := newFixture(t)
	ctx, root := tp.Tracer("test").Start(f.Ctx, "http.request")
	res, err := transfer.Settle(ctx, f.Pool, transfer.Transfer{ID: uuid.New(), FromAccount: "a", ToAccount: "b", AmountCents: 10})
	root.End()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := relaytest.DrainBatch(f.Ctx, f.NewRelay(f.RelayConfig("r1"), nil)); err != nil {
		t.Fatal(err)
	}
	f.Run(f.consumer("c1", nil).Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return f.report().Verdicts == 1 }, "event not processed")

	byName := map[string]tracetest.SpanStub{}
	outboxtest.Eventually(t, 5*time.Second, func() bool {
		for _, s := range exp.GetSpans() {
			byName[s.Name] = s
		}
		_, ok := byName["fraud.process"]
		return ok
	}, "no fraud.process span")
	settle, publish, process := byName["transfer.settle"], byName["outbox.publish"], byName["fraud.process"]
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
	var eventID string
	for _, a := range process.Attributes {
		if a.Key == "messaging.message.id" {
			eventID = a.Value.AsString()
		}
	}
	if eventID != res.EventID.String() {
		t.Fatalf("process span is for event %q, want %s", eventID, res.EventID)
	}
}
