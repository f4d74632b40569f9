// Package tracing carries W3C trace context through the outbox: into the
// event headers at write time, from the row headers into the stream entry at
// publish time, and out of the entry at consume time, so that one trace spans
// settle → publish → process. Spans go to the global OpenTelemetry tracer
// provider: a no-op unless the embedding service (or, in the commands,
// internal/traceexport) installs one. This package links the OpenTelemetry
// API only: no SDK, no exporter, no gRPC (internal/deps asserts the
// footprint).
package tracing

import (
	"bytes"
	"context"
	"encoding/json"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// HeaderTraceparent is the header that holds the W3C trace context.
const HeaderTraceparent = "traceparent"

var propagator = propagation.TraceContext{}

// Tracer returns the tracer for an instrumentation scope (a package path).
func Tracer(scope string) trace.Tracer { return otel.Tracer(scope) }

// Inject adds the trace context of ctx (traceparent, tracestate) to headers,
// if ctx carries a valid span context.
func Inject(ctx context.Context, headers map[string]string) {
	if trace.SpanContextFromContext(ctx).IsValid() {
		propagator.Inject(ctx, propagation.MapCarrier(headers))
	}
}

// Extract returns ctx with the remote span context found in headers.
func Extract(ctx context.Context, headers map[string]string) context.Context {
	return propagator.Extract(ctx, propagation.MapCarrier(headers))
}

// ExtractJSON is Extract for headers encoded as a JSON object. It does no
// work for headers without a traceparent, the common case when tracing is
// off.
func ExtractJSON(ctx context.Context, raw []byte) context.Context {
	if !bytes.Contains(raw, []byte(HeaderTraceparent)) {
		return ctx
	}
	var h map[string]string
	if json.Unmarshal(raw, &h) != nil {
		return ctx
	}
	return Extract(ctx, h)
}

// ReplaceJSON returns raw (a JSON object of headers) with the trace context
// of ctx in place of the one it had. It returns raw unchanged when ctx has no
// valid span context or raw is not a JSON object of strings.
func ReplaceJSON(ctx context.Context, raw []byte) []byte {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return raw
	}
	h := map[string]string{}
	if len(bytes.TrimSpace(raw)) > 0 && json.Unmarshal(raw, &h) != nil {
		return raw
	}
	propagator.Inject(ctx, propagation.MapCarrier(h))
	out, err := json.Marshal(h)
	if err != nil {
		return raw
	}
	return out
}
