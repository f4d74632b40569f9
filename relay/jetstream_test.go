package relay_test

import (
	"context"
	"github.com/tedbank/outbox/internal/relaytest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tedbank/outbox/internal/natsjs"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/tcpproxy"
	"github.com/tedbank/outbox/internal/testenv"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/relay/entry"
	"github.com/tedbank/outbox/relay/natsbroker"
)

// jetStreamRelay returns a relay of f publishing to a JetStream stream of
// the test's own, and the stream.
func (f *fixture) jetStreamRelay(name string) (*relay.Relay, jetstream.JetStream, string) {
	f.T.Helper()
	nc, js, err := natsjs.Connect(outboxtest.NATSURL(f.T), "outbox-test")
	if err != nil {
		f.T.Fatal(err)
	}
	f.T.Cleanup(nc.Close)
	stream := outboxtest.NATSStream(f.T)
	r, err := natsbroker.NewRelay(f.Pool, natsbroker.Config{JS: js, Stream: stream}, f.RelayConfig(name))
	if err != nil {
		f.T.Fatal(err)
	}
	return r, js, stream
}

// On NATS JetStream every event is published to the subject named as its
// Redis stream would be, its body the payload, the entry's fields as
// headers and Nats-Msg-Id the event id; its outbox row records the stream
// sequence. Published again (its mark lost), it is dropped by the server's
// duplicate window: the stream holds each event once, and the row gets the
// first publication's sequence again.
func TestJetStreamPublishesEachEventOnce(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	teds := f.Settle(20)
	r, js, stream := f.jetStreamRelay("r1")
	if n := f.DrainAll(r); n != 20 {
		t.Fatalf("published %d, want 20", n)
	}
	ctx := context.Background()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil || info.State.Msgs != 20 {
		t.Fatalf("stream %s: %+v (%v), want 20 messages", stream, info, err)
	}
	seqOf, keyOf := map[string]string{}, map[string]string{}
	for seq := uint64(1); seq <= 20; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		id := m.Header.Get(entry.EventID)
		if m.Subject != f.Stream() || m.Header.Get(jetstream.MsgIDHeader) != id || m.Header.Get(entry.EventType) != "transfer.settled" || len(m.Data) == 0 {
			t.Fatalf("message %d: subject %s headers %v body %q", seq, m.Subject, m.Header, m.Data)
		}
		seqOf[id] = strconv.FormatUint(seq, 10)
		keyOf[id] = m.Header.Get(entry.PartitionKey)
	}
	rows, err := f.Pool.Query(ctx, "SELECT id::text, stream_id, coalesce(partition_key, aggregate_id) FROM outbox_messages WHERE status = 'published'")
	if err != nil {
		t.Fatal(err)
	}
	marked := 0
	for rows.Next() {
		var id, streamID, key string
		if err := rows.Scan(&id, &streamID, &key); err != nil {
			t.Fatal(err)
		}
		if seqOf[id] != streamID {
			t.Errorf("event %s: stream_id %q, want its sequence %q", id, streamID, seqOf[id])
		}
		if keyOf[id] != key {
			t.Errorf("event %s: header %s %q, want its partition key %q", id, entry.PartitionKey, keyOf[id], key)
		}
		marked++
	}
	if marked != len(teds) {
		t.Fatalf("%d rows marked published, want %d", marked, len(teds))
	}

	// Five marks lost: the relay publishes them again.
	f.Exec(`UPDATE outbox_messages SET status = 'pending', published_at = NULL, stream_id = NULL
	         WHERE id IN (SELECT id FROM outbox_messages ORDER BY seq LIMIT 5)`)
	if n := f.DrainAll(r); n != 5 {
		t.Fatalf("published again %d, want 5", n)
	}
	if info, err := s.Info(ctx); err != nil || info.State.Msgs != 20 {
		t.Fatalf("stream %+v (%v): the re-publications must be dropped as duplicates", info, err)
	}
	if n := f.Count("SELECT count(*) FROM outbox_messages WHERE stream_id::bigint BETWEEN 1 AND 5 AND status = 'published'"); n != 5 {
		t.Fatalf("%d of the re-published rows have their first sequence, want 5", n)
	}
}

// With NATS down, settlements keep committing; the relay backs off, counts
// no attempt against the events, and publishes everything once the server
// is back.
func TestJetStreamOutageCountsNoAttempt(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	srv, err := testenv.LocalNATS(context.Background(), testenv.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	nc, js, err := natsjs.Connect(srv.URL, "outbox-test")
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	r, err := natsbroker.NewRelay(f.Pool, natsbroker.Config{JS: js, Stream: "OUTAGE"}, f.RelayConfig("r1"))
	if err != nil {
		t.Fatal(err)
	}
	f.Settle(5)
	if n := f.DrainAll(r); n != 5 {
		t.Fatalf("published %d, want 5", n)
	}
	if err := srv.Stop(); err != nil {
		t.Fatal(err)
	}
	f.Settle(5)
	res, err := relaytest.DrainBatch(f.Ctx, r)
	if err == nil && !res.BrokerDown {
		t.Fatalf("drain with NATS down: %+v %v, want the broker reported down", res, err)
	}
	if n := f.Count("SELECT count(*) FROM outbox_messages WHERE attempts > 0"); n != 0 {
		t.Fatalf("%d events had an attempt counted for a NATS outage", n)
	}
	if err := srv.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	outboxtest.Eventually(t, 15*time.Second, func() bool {
		_, _ = relaytest.DrainBatch(f.Ctx, r)
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 10
	}, "the relay did not publish after NATS came back")
}

// A half-open connection to NATS (its packets swallowed, nothing closed)
// costs one batch: the publish that gets no acknowledgement makes the relay
// reconnect, and the retry goes through a new connection, without waiting
// for the pings to notice.
func TestJetStreamHalfOpenConnectionIsReplaced(t *testing.T) {
	f := newFixture(t)
	px, err := tcpproxy.Start(strings.TrimPrefix(outboxtest.NATSURL(t), "nats://"))
	if err != nil {
		t.Fatal(err)
	}
	defer px.Close()
	nc, js, err := natsjs.Connect("nats://"+px.Addr(), "outbox-test")
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	cfg := f.RelayConfig("r1")
	cfg.Lease, cfg.PublishTimeout = 4*time.Second, time.Second
	r, err := natsbroker.NewRelay(f.Pool, natsbroker.Config{JS: js, Stream: outboxtest.NATSStream(t)}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	f.Settle(3)
	if n := f.DrainAll(r); n != 3 {
		t.Fatalf("published %d, want 3", n)
	}
	px.Freeze() // the connection goes silent; new ones flow
	f.Settle(3)
	res, err := relaytest.DrainBatch(f.Ctx, r)
	if err == nil && !res.BrokerDown {
		t.Fatalf("drain over a silent connection: %+v %v, want the broker down", res, err)
	}
	started := time.Now()
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		_, _ = relaytest.DrainBatch(f.Ctx, r)
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 6
	}, "not published after the connection went silent")
	// The pings would have taken about 6s to give the connection up.
	if took := time.Since(started); took > 3*time.Second {
		t.Fatalf("published %s after the failed batch: the relay waited for the pings instead of reconnecting", took)
	}
}
