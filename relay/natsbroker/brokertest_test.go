package natsbroker_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/tedbank/outbox/internal/natsjs"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/tcpproxy"
	"github.com/tedbank/outbox/relay/broker/brokertest"
	"github.com/tedbank/outbox/relay/entry"
	"github.com/tedbank/outbox/relay/natsbroker"
)

func TestMain(m *testing.M) { outboxtest.Main(m) }

// The broker passes the seam's kit on a real NATS JetStream: it publishes
// through a proxy that the outage check takes down, and the check reads the
// stream on a connection of its own.
func TestBrokerKit(t *testing.T) {
	brokertest.Run(t, func(t *testing.T) brokertest.Harness {
		url := outboxtest.NATSURL(t)
		px, err := tcpproxy.Start(strings.TrimPrefix(url, "nats://"))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = px.Close() })
		nc, js, err := natsjs.Connect("nats://"+px.Addr(), "brokertest")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		readConn, reader, err := natsjs.Connect(url, "brokertest-read")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(readConn.Close)
		stream := outboxtest.NATSStream(t)
		prefix := "kit" + strings.ReplaceAll(uuid.NewString()[:8], "-", "") + "."
		b, err := natsbroker.New(natsbroker.Config{JS: js, Stream: stream, SubjectPrefix: prefix})
		if err != nil {
			t.Fatal(err)
		}
		return brokertest.Harness{
			Broker: b,
			Dest:   func(name string) string { return prefix + name },
			Read: func(ctx context.Context, subject string) ([]brokertest.Entry, error) {
				return readSubject(ctx, reader, stream, subject)
			},
			Down: px.Down,
			Up:   px.Up,
		}
	})
}

// readSubject returns the messages of stream on subject, oldest first: the
// headers are the entry's fields, the body its payload, the stream
// sequence its id.
func readSubject(ctx context.Context, js jetstream.JetStream, stream, subject string) ([]brokertest.Entry, error) {
	s, err := js.Stream(ctx, stream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil, err
	}
	var entries []brokertest.Entry
	for seq := info.State.FirstSeq; seq > 0 && seq <= info.State.LastSeq; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		if m.Subject != subject {
			continue
		}
		fields := map[string]string{entry.Payload: string(m.Data)}
		for k := range m.Header {
			fields[k] = m.Header.Get(k)
		}
		entries = append(entries, brokertest.Entry{ID: strconv.FormatUint(seq, 10), Fields: fields})
	}
	return entries, nil
}
