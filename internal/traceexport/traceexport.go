// Package traceexport installs the commands' OpenTelemetry tracer provider
// and exporter from the standard OTEL_* variables. It lives apart from
// internal/tracing, which the library packages import, so that a service
// importing the library links no OpenTelemetry SDK, exporter or gRPC: the
// service installs its own provider, and only the commands link this one.
package traceexport

import (
	"context"
	"fmt"
	"log/slog"
	"os"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"
)

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
