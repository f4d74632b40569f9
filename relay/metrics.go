package relay

import (
	"context"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tedbank/outbox/internal/queries"
)

// Metrics are the relay's Prometheus metrics. A nil *Metrics records nothing.
type Metrics struct {
	mu         sync.Mutex
	eventTypes map[string]bool // label values in use

	published       prometheus.Counter
	publishFailures *prometheus.CounterVec
	released        prometheus.Counter
	fenced          prometheus.Counter
	reaped          prometheus.Counter
	batchSize       prometheus.Histogram
	batchDuration   prometheus.Histogram
	publishDelay    prometheus.Histogram
	listenConnected prometheus.Gauge
	notifications   prometheus.Counter
	polls           prometheus.Counter
	pollsWithWork   prometheus.Counter
	slotsHeld       prometheus.Gauge
	takeovers       prometheus.Counter
}

// NewMetrics creates the relay metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		eventTypes: map[string]bool{},
		published: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_published_total", Help: "Events published to Redis and marked published."}),
		publishFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_relay_publish_failures_total", Help: "Failed publish attempts charged to an event, by event type."},
			[]string{"event_type"}),
		released: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_released_total", Help: "Claimed events given back without an attempt (Redis unavailable, shutdown)."}),
		fenced: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_fenced_total", Help: "Events published after this relay's claim was taken over (lease expired)."}),
		reaped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_reaped_total", Help: "Expired claims returned to pending by this relay's reaper."}),
		batchSize: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "outbox_relay_batch_size", Help: "Events per claimed batch.",
			Buckets: []float64{1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000}}),
		batchDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "outbox_relay_batch_duration_seconds", Help: "Time to claim, publish and mark one batch.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16)}),
		publishDelay: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "outbox_relay_publish_delay_seconds", Help: "From the event's transaction start (created_at) to its XADD.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 20)}),
		listenConnected: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_listen_connected", Help: "1 while the LISTEN connection is established."}),
		notifications: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_notifications_total", Help: "NOTIFY wake-ups received."}),
		polls: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_polls_total", Help: "Fallback polls."}),
		pollsWithWork: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_polls_with_work_total", Help: "Fallback polls that found events: a non-zero rate means wake-ups are being missed."}),
		slotsHeld: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "outbox_relay_partition_slots", Help: "Partition slots this relay holds a lease on (--ownership partitions; 0 with row claims)."}),
		takeovers: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "outbox_relay_takeovers_total", Help: "Times this relay took over the claims or slots of relays that died (their LISTEN backend gone)."}),
	}
	reg.MustRegister(m.published, m.publishFailures, m.released, m.fenced, m.reaped, m.batchSize, m.batchDuration,
		m.publishDelay, m.listenConnected, m.notifications, m.polls, m.pollsWithWork, m.slotsHeld, m.takeovers)
	return m
}

func (m *Metrics) batch(res BatchResult, took time.Duration) {
	if m == nil || res.Claimed == 0 {
		return
	}
	m.batchSize.Observe(float64(res.Claimed))
	m.batchDuration.Observe(took.Seconds())
	m.released.Add(float64(res.Released))
}

func (m *Metrics) marked(published, fenced int) {
	if m == nil {
		return
	}
	m.published.Add(float64(published))
	m.fenced.Add(float64(fenced))
}

// maxEventTypeLabels bounds the event_type label: the generic write API
// accepts any event type, so past this many the rest count as "other".
const maxEventTypeLabels = 100

func (m *Metrics) failure(eventType string) {
	if m == nil {
		return
	}
	m.mu.Lock()
	if !m.eventTypes[eventType] {
		if len(m.eventTypes) >= maxEventTypeLabels {
			eventType = "other"
		} else {
			m.eventTypes[eventType] = true
		}
	}
	m.mu.Unlock()
	m.publishFailures.WithLabelValues(eventType).Inc()
}

// The recording methods do nothing on a nil *Metrics (no metrics
// configured), so callers need no nil check.

func (m *Metrics) notified() {
	if m != nil {
		m.notifications.Inc()
	}
}

// polled(false) counts a fallback poll when it starts; polled(true) counts,
// once it drained, that it found rows.
func (m *Metrics) polled(withWork bool) {
	switch {
	case m == nil:
	case withWork:
		m.pollsWithWork.Inc()
	default:
		m.polls.Inc()
	}
}

func (m *Metrics) reapedRows(n int) {
	if m != nil {
		m.reaped.Add(float64(n))
	}
}

func (m *Metrics) delay(d time.Duration) {
	if m != nil {
		m.publishDelay.Observe(d.Seconds())
	}
}

func (m *Metrics) listen(up bool) {
	if m != nil {
		v := 0.0
		if up {
			v = 1
		}
		m.listenConnected.Set(v)
	}
}

// OutboxCollector exports the state of outbox_messages at scrape time: rows
// per unpublished status and the age of the oldest pending row (the alert
// that matters). Its queries use the partial indexes, so they stay cheap
// however many published rows the table holds.
type OutboxCollector struct {
	pool   *pgxpool.Pool
	query  queries.Statement
	rows   *prometheus.Desc
	oldest *prometheus.Desc
	retry  *prometheus.Desc
	xact   *prometheus.Desc
	up     *prometheus.Desc
}

// NewOutboxCollector returns a collector reading outbox_messages with pool.
func NewOutboxCollector(pool *pgxpool.Pool) *OutboxCollector {
	return &OutboxCollector{
		pool:  pool,
		query: queries.MetricsOutbox(),
		rows: prometheus.NewDesc("outbox_messages", "Outbox rows per status (published rows are not counted).",
			[]string{"status"}, nil),
		oldest: prometheus.NewDesc("outbox_oldest_pending_age_seconds",
			"Age of the oldest pending outbox row, 0 when none.", nil, nil),
		retry: prometheus.NewDesc("outbox_messages_retrying",
			"Unpublished outbox rows that failed at least once and wait for a retry.", nil, nil),
		xact: prometheus.NewDesc("outbox_oldest_transaction_age_seconds",
			"Age of the database's oldest client transaction holding back the xmin horizon (a snapshot or a transaction id), 0 when none: "+
				"while it is open the outbox's dead index entries stay and a backlog drains slower.", nil, nil),
		up: prometheus.NewDesc("outbox_database_up", "1 if the last scrape could read the outbox.", nil, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *OutboxCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.rows
	ch <- c.oldest
	ch <- c.retry
	ch <- c.xact
	ch <- c.up
}

// Collect implements prometheus.Collector.
func (c *OutboxCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var pending, publishing, dead, retrying int64
	var oldest, xact float64
	err := c.pool.QueryRow(ctx, c.query.SQL, c.query.Args...).Scan(&pending, &publishing, &dead, &oldest, &retrying, &xact)
	if err != nil {
		ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 0)
		return
	}
	ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 1)
	ch <- prometheus.MustNewConstMetric(c.rows, prometheus.GaugeValue, float64(pending), "pending")
	ch <- prometheus.MustNewConstMetric(c.rows, prometheus.GaugeValue, float64(publishing), "publishing")
	ch <- prometheus.MustNewConstMetric(c.rows, prometheus.GaugeValue, float64(dead), "dead")
	ch <- prometheus.MustNewConstMetric(c.oldest, prometheus.GaugeValue, oldest)
	ch <- prometheus.MustNewConstMetric(c.retry, prometheus.GaugeValue, float64(retrying))
	ch <- prometheus.MustNewConstMetric(c.xact, prometheus.GaugeValue, xact)
}

func (m *Metrics) slots(n int) {
	if m == nil {
		return
	}
	m.slotsHeld.Set(float64(n))
}

func (m *Metrics) takeover() {
	if m != nil {
		m.takeovers.Inc()
	}
}
