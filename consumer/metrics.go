package consumer

import (
	"context"
	"github.com/tedbank/outbox/consumer/source"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/partition"
)

// Metrics are the consumer's Prometheus metrics. A nil *Metrics records
// nothing.
type Metrics struct {
	processed    *prometheus.CounterVec
	duplicates   prometheus.Counter
	deadLettered prometheus.Counter
	failed       prometheus.Counter
	batch        prometheus.Histogram
	takeovers    prometheus.Counter
}

// NewMetrics creates the metrics of a consumer of kind name (Config.Name):
// outbox_<name>_events_processed_total, counted by outcome under the label
// outcomeLabel ("outcome" if empty), outbox_<name>_duplicates_skipped_total,
// outbox_<name>_dead_lettered_total, outbox_<name>_failures_total,
// outbox_<name>_batch_duration_seconds and outbox_<name>_takeovers_total;
// and registers them with reg.
func NewMetrics(reg prometheus.Registerer, name, outcomeLabel string) *Metrics {
	if outcomeLabel == "" {
		outcomeLabel = "outcome"
	}
	prefix := "outbox_" + name + "_"
	m := &Metrics{
		processed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: prefix + "events_processed_total", Help: "Events whose effect was applied, by " + outcomeLabel + "."},
			[]string{outcomeLabel}),
		duplicates: prometheus.NewCounter(prometheus.CounterOpts{
			Name: prefix + "duplicates_skipped_total", Help: "Deliveries recognised as already applied."}),
		deadLettered: prometheus.NewCounter(prometheus.CounterOpts{
			Name: prefix + "dead_lettered_total", Help: "Entries moved to the dead-letter stream."}),
		failed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: prefix + "failures_total", Help: "Deliveries that failed and stay pending."}),
		batch: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: prefix + "batch_duration_seconds", Help: "Time to apply and acknowledge one batch of entries.",
			Buckets: prometheus.ExponentialBuckets(0.0002, 2, 16)}),
		takeovers: prometheus.NewCounter(prometheus.CounterOpts{
			Name: prefix + "takeovers_total", Help: "Consumers of the group this one found dead (their Redis connection gone) and whose partitions it gave back."}),
	}
	reg.MustRegister(m.processed, m.duplicates, m.deadLettered, m.failed, m.batch, m.takeovers)
	return m
}

func (m *Metrics) outcome(o string) {
	if m == nil {
		return
	}
	if o == Duplicate {
		m.duplicates.Inc()
		return
	}
	m.processed.WithLabelValues(o).Inc()
}

// failedEntry and deadLetter do nothing on a nil *Metrics, as every
// recording method.
func (m *Metrics) failedEntry() {
	if m != nil {
		m.failed.Inc()
	}
}

func (m *Metrics) takeover() {
	if m != nil {
		m.takeovers.Inc()
	}
}

func (m *Metrics) deadLetter() {
	if m != nil {
		m.deadLettered.Inc()
	}
}

func (m *Metrics) observeBatch(d time.Duration) {
	if m != nil {
		m.batch.Observe(d.Seconds())
	}
}

// GroupCollector exports a consumer group's pending count and lag, read with
// XINFO GROUPS at scrape time.
type GroupCollector struct {
	src              source.Source // where the group's partitions are read: Redis Streams unless WithSource says otherwise
	stream, group    string
	partitions       int
	pending, lag, up *prometheus.Desc
}

// WithSource makes the collector read the group's partitions on src
// (NewWithSource; on NATS JetStream, its durable consumers): pending is
// their messages delivered and not acknowledged, lag those not delivered
// yet; outbox_<name>_redis_up then says whether the source could be read.
func (c *GroupCollector) WithSource(src source.Source) *GroupCollector {
	c.src = src
	return c
}

// WithPartitions makes the collector sum the group's figures over the n
// partition streams of its stream (labelled with the stream's base name).
func (c *GroupCollector) WithPartitions(n int) *GroupCollector {
	c.partitions = n
	return c
}

// NewGroupCollector returns a collector for group on stream, of a consumer
// of kind name (Config.Name): outbox_<name>_group_pending,
// outbox_<name>_group_lag and outbox_<name>_redis_up.
func NewGroupCollector(rdb redis.Cmdable, name, stream, group string) *GroupCollector {
	labels := prometheus.Labels{"stream": stream, "group": group}
	prefix := "outbox_" + name + "_"
	return &GroupCollector{
		src: newStreams(rdb, Config{}, nil), stream: stream, group: group,
		pending: prometheus.NewDesc(prefix+"group_pending", "Entries delivered to the group and not yet acknowledged.", nil, labels),
		lag:     prometheus.NewDesc(prefix+"group_lag", "Entries in the stream not yet delivered to the group.", nil, labels),
		up:      prometheus.NewDesc(prefix+"redis_up", "1 if the last scrape could read the consumer group from Redis.", nil, labels),
	}
}

// Describe implements prometheus.Collector.
func (c *GroupCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.pending
	ch <- c.lag
	ch <- c.up
}

// Collect implements prometheus.Collector.
func (c *GroupCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var pending, lag int64
	found, lagKnown := false, true
	for p, subject := range partition.Streams(c.stream, max(c.partitions, 1)) {
		pn, ln, ok, err := c.src.Backlog(ctx, c.group, subject, p)
		if err != nil {
			ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 0)
			return
		}
		if ok {
			found = true
			pending += pn
			lag += ln
			lagKnown = lagKnown && ln >= 0 // negative: the source cannot tell (Redis: entries deleted)
		}
	}
	ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 1)
	if found {
		ch <- prometheus.MustNewConstMetric(c.pending, prometheus.GaugeValue, float64(pending))
		if lagKnown {
			ch <- prometheus.MustNewConstMetric(c.lag, prometheus.GaugeValue, float64(lag))
		}
	}
}
