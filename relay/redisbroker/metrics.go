package redisbroker

import "github.com/prometheus/client_golang/prometheus"

// Metrics are the broker's Prometheus metrics. A nil *Metrics records
// nothing.
type Metrics struct {
	trimmed prometheus.Counter
}

// NewMetrics creates the broker's metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		trimmed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_trimmed_total", Help: "Stream entries trimmed (all read and acknowledged by every group)."}),
	}
	reg.MustRegister(m.trimmed)
	return m
}

func (m *Metrics) trimmedEntries(n int64) {
	if m != nil {
		m.trimmed.Add(float64(n))
	}
}
