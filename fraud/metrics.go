package fraud

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer"
)

// Metrics are the consumer's Prometheus metrics (consumer.Metrics).
type Metrics = consumer.Metrics

// NewMetrics creates anti-fraud's metrics and registers them with reg:
// outbox_fraud_events_processed_total (by verdict),
// outbox_fraud_duplicates_skipped_total, outbox_fraud_dead_lettered_total,
// outbox_fraud_failures_total and outbox_fraud_batch_duration_seconds.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	return consumer.NewMetrics(reg, "fraud", "verdict")
}

// GroupCollector exports a consumer group's pending count and lag
// (consumer.GroupCollector).
type GroupCollector = consumer.GroupCollector

// NewGroupCollector returns a collector for group on stream:
// outbox_fraud_group_pending, outbox_fraud_group_lag, outbox_fraud_redis_up.
func NewGroupCollector(rdb redis.Cmdable, stream, group string) *GroupCollector {
	return consumer.NewGroupCollector(rdb, "fraud", stream, group)
}
