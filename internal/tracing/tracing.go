// Package tracing carries W3C trace context through the outbox: into the
// event headers at write time, from the row headers into the stream entry at
// publish time, and out of the entry at consume time, so that one trace spans
// settle → publish → process. Spans go to the global OpenTelemetry tracer
// provider: a no-op unless Setup (or the embedding service) installs one.
package tracing

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"
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

// Setup installs a tracer provider that exports spans when the standard
// OpenTelemetry variables ask for it (OTEL_TRACES_EXPORTER, or an
// OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT); otherwise it does nothing. The
// returned function flushes and stops the exporter. The exporter's own errors
// (an unreachable collector) go to log, in the command's log format; the
// console exporter writes to stderr, never into the command's output.
func Setup(ctx context.Context, serviceName string, log *slog.Logger) (shutdown func(context.Context) error, err error) {
	noop := func(context.Context) error { return nil }
	kind := os.Getenv("OTEL_TRACES_EXPORTER")
	if kind == "" && os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") == "" &&
		os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == "" {
		return noop, nil
	}
	if log != nil {
		otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
			log.Warn("trace export failed", slog.Any("error", err))
		}))
	}
	var exp sdktrace.SpanExporter
	switch kind {
	case "none":
		return noop, nil
	case "console":
		exp, err = stdouttrace.New(stdouttrace.WithWriter(os.Stderr))
	case "", "otlp":
		exp, err = otlpExporter(ctx)
	default:
		return noop, fmt.Errorf("OTEL_TRACES_EXPORTER=%q: unknown trace exporter; want otlp, console or none", kind)
	}
	if err != nil {
		return noop, fmt.Errorf("trace exporter (OTEL_TRACES_EXPORTER=%q): %w", kind, err)
	}
	res := resource.Default() // honours OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
	if os.Getenv("OTEL_SERVICE_NAME") == "" {
		if merged, err := resource.Merge(res, resource.NewSchemaless(semconv.ServiceName(serviceName))); err == nil {
			res = merged
		}
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	otel.SetTracerProvider(tp)
	return tp.Shutdown, nil
}

// otlpExporter is the OTLP span exporter of the protocol the standard
// variables name (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else
// OTEL_EXPORTER_OTLP_PROTOCOL; http/protobuf by default). Both exporters read
// the other OTEL_EXPORTER_OTLP_* variables (endpoint, headers, TLS, timeout)
// themselves. Only the trace exporters are linked: the commands export no
// OTLP metrics or logs (metrics are Prometheus text on --metrics-addr).
func otlpExporter(ctx context.Context) (sdktrace.SpanExporter, error) {
	protocol := os.Getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
	if protocol == "" {
		protocol = os.Getenv("OTEL_EXPORTER_OTLP_PROTOCOL")
	}
	switch protocol {
	case "", "http/protobuf":
		return otlptracehttp.New(ctx)
	case "grpc":
		return otlptracegrpc.New(ctx)
	}
	return nil, fmt.Errorf("OTEL_EXPORTER_OTLP_PROTOCOL=%q: unsupported; want http/protobuf or grpc", protocol)
}
