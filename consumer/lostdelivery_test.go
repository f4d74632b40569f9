package consumer

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/tedbank/outbox/consumer/natssource"
	"github.com/tedbank/outbox/internal/natsjs"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/relay/entry"
)

// pullProxy forwards a NATS connection; once armed, the first pull request
// (a PUB to $JS.API.CONSUMER.MSG.NEXT.) that the client sends makes the link
// drop whatever the server sends from then on: the reply to that pull is
// lost as in a connection that is about to be replaced.
type pullProxy struct {
	ln    net.Listener
	armed atomic.Bool
}

func startPullProxy(t *testing.T, target string) *pullProxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &pullProxy{ln: ln}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			var drop atomic.Bool
			go func() { // client -> server
				buf := make([]byte, 32<<10)
				for {
					n, err := c.Read(buf)
					if n > 0 {
						if p.armed.Load() && bytes.Contains(buf[:n], []byte("$JS.API.CONSUMER.MSG.NEXT.")) && p.armed.CompareAndSwap(true, false) {
							drop.Store(true)
						}
						if _, werr := s.Write(buf[:n]); werr != nil {
							break
						}
					}
					if err != nil {
						break
					}
				}
				s.Close()
				c.Close()
			}()
			go func() { // server -> client
				buf := make([]byte, 32<<10)
				for {
					n, err := s.Read(buf)
					if n > 0 && !drop.Load() {
						if _, werr := c.Write(buf[:n]); werr != nil {
							break
						}
					}
					if err != nil {
						break
					}
				}
				_, _ = io.Copy(io.Discard, s)
				s.Close()
				c.Close()
			}()
		}
	}()
	return p
}

// blockingRecorder records effects and blocks on the event "gate" until
// released.
type blockingRecorder struct {
	*recorder
	gate    chan struct{}
	reached chan struct{}
	once    sync.Once
}

func (r *blockingRecorder) Handle(ctx context.Context, b Batch) []Result {
	for _, m := range b.Messages {
		if m.AggregateID == "gate" {
			r.once.Do(func() { close(r.reached); <-r.gate })
		}
	}
	return r.recorder.Handle(ctx, b)
}

// Messages JetStream delivered into a connection that was then replaced
// (the reply to a fetch lost) are not skipped: the reader sees the gap in
// the durable's delivery sequence, hands over what came before it and
// fails, and the partition is read again from its ack floor, so each key's
// lost message takes effect before its later ones. Without the check, the
// fetch gave up quietly and the reader applied the next second's messages
// first (the conformance suite saw it once under load: four senders' events
// each applied after eleven later ones).
func TestJetStreamDeliveriesLostWithTheConnectionKeepTheirOrder(t *testing.T) {
	e := newJSEnv(t)
	px := startPullProxy(t, strings.TrimPrefix(outboxtest.NATSURL(t), "nats://"))
	nc, js, err := natsjs.Connect("nats://"+px.ln.Addr().String(), "outbox-test-proxied")
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	h := &blockingRecorder{recorder: newRecorder(e.rdb.Client), gate: make(chan struct{}), reached: make(chan struct{})}
	pub := func(agg, key string) {
		_, err := e.js.PublishMsg(context.Background(), &nats.Msg{Subject: e.cfg.Stream, Data: []byte(`{}`), Header: nats.Header{
			jetstream.MsgIDHeader: {uuid.NewString()}, entry.EventID: {uuid.NewString()}, entry.EventType: {"test.happened"},
			entry.AggregateType: {"test"}, entry.AggregateID: {agg}, entry.Headers: {"{}"}, entry.PartitionKey: {key},
		}})
		if err != nil {
			t.Fatal(err)
		}
	}
	c, err := NewWithSource(e.rdb.Client, natssource.New(js), h, e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer start(c)()

	pub("gate", "G")
	<-h.reached // the worker applies "gate": it is busy
	for _, k := range []string{"A", "B", "C", "D"} {
		pub(k+"2", k)
	}
	px.armed.Store(true) // the reply to the worker's next pull is lost
	close(h.gate)
	stream, _ := e.js.StreamNameBySubject(context.Background(), e.cfg.Stream)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		d, err := natssource.Durable(context.Background(), e.js, stream, "test", 0)
		return err == nil && d.CachedInfo().NumAckPending == 4
	}, "the server never delivered A2..D2")
	// What a relay's stale publish or another reader's "silent" fetch does
	// to a shared connection.
	_ = nc.ForceReconnect()
	for i := 3; i <= 5; i++ {
		for _, k := range []string{"A", "B", "C", "D"} {
			pub(fmt.Sprint(k, i), k)
		}
		time.Sleep(50 * time.Millisecond)
	}
	outboxtest.Eventually(t, 15*time.Second, func() bool { return len(h.effects()) == 17 }, "effects %v", h.effects())
	got := fmt.Sprint(h.effects())
	t.Logf("effects in order: %s", got)
	pos := map[string]int{}
	for i, a := range h.effects() {
		pos[a] = i
	}
	for _, k := range []string{"A", "B", "C", "D"} {
		if pos[k+"3"] < pos[k+"2"] {
			t.Errorf("key %s: %s3 took effect before %s2", k, k, k)
		}
	}
}
