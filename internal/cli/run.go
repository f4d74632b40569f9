package cli

import (
	"context"
	"log/slog"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tedbank/outbox/internal/metrics"
)

// runnable is a relay or a consumer.
type runnable interface {
	Ready(ctx context.Context) error
	Run(ctx context.Context) error
}

// serveAndRun serves /metrics, /healthz and /readyz (r.Ready) on addr, when
// set, and runs r until ctx is cancelled.
func serveAndRun(ctx context.Context, addr string, reg *prometheus.Registry, r runnable, log *slog.Logger) error {
	if addr != "" {
		bound, err := metrics.Serve(ctx, addr, reg, r.Ready, log)
		if err != nil {
			return err
		}
		log.Info("serving metrics", "addr", bound)
	}
	return r.Run(ctx)
}
