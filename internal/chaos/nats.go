package chaos

import (
	"context"
	"errors"
	"fmt"
	"github.com/tedbank/outbox/consumer/natssource"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/tedbank/outbox/internal/natsjs"
	"github.com/tedbank/outbox/internal/tcpproxy"
	"github.com/tedbank/outbox/internal/testenv"
	"github.com/tedbank/outbox/partition"
)

// NATS mode: the relays publish to NATS JetStream and the consumers read it
// (--broker nats), through a proxy (blackholes); the run's own nats-server
// keeps its JetStream store in its directory, so a kill and restart keeps
// every stored message. The monitor reads the stream and the group's durable
// consumers straight from the server.

// setupNATS starts the nats-server and its proxy and returns the processes'
// arguments.
func (r *run) setupNATS(ctx context.Context) ([]string, error) {
	var err error
	if r.nats, err = testenv.LocalNATS(ctx, testenv.Options{}); err != nil {
		return nil, err
	}
	addr := hostPort(r.nats.URL)
	if r.natsProxy, err = tcpproxy.Start(addr); err != nil {
		return nil, err
	}
	r.proxyNATS = strings.Replace(r.nats.URL, addr, r.natsProxy.Addr(), 1)
	if r.nc, r.js, err = natsjs.Connect(r.nats.URL, "chaos-monitor"); err != nil {
		return nil, err
	}
	r.logf("nats %s with JetStream (dir %s), through %s", r.nats.URL, r.nats.Dir(), r.proxyNATS)
	return []string{"--broker", "nats", "--nats-url", r.proxyNATS}, nil
}

// natsGroup reads the group's durable consumer of every partition: messages
// delivered and not acknowledged, and whether every stored message was
// delivered.
func (r *run) natsGroup(ctx context.Context) (pending int64, delivered bool, err error) {
	delivered = true
	for p, subject := range partition.Streams(stream, r.parts) {
		name, err := r.js.StreamNameBySubject(ctx, subject)
		if err != nil {
			return 0, false, err
		}
		cons, err := natssource.Durable(ctx, r.js, name, group, p)
		if errors.Is(err, jetstream.ErrConsumerNotFound) {
			delivered = false // not taken over yet
			continue
		}
		if err != nil {
			return 0, false, err
		}
		info := cons.CachedInfo()
		pending += int64(info.NumAckPending)
		delivered = delivered && info.NumPending == 0
	}
	return pending, delivered, nil
}

// natsEntries reads every message of the JetStream stream: per event id,
// how many copies, and when its first was stored (as a "<ms>-0" entry id,
// which the stranded analysis reads as the publish time).
func (r *run) natsEntries(ctx context.Context) (copies map[string]int, total int, err error) {
	name, err := r.js.StreamNameBySubject(ctx, stream)
	if err != nil {
		return nil, 0, err
	}
	s, err := r.js.Stream(ctx, name)
	if err != nil {
		return nil, 0, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil, 0, err
	}
	copies = map[string]int{}
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && seq > 0; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return nil, 0, fmt.Errorf("message %d of %s: %w", seq, name, err)
		}
		id := m.Header.Get("event_id")
		copies[id]++
		if _, ok := r.firstEntry[id]; !ok {
			r.firstEntry[id] = fmt.Sprintf("%d-0", m.Time.UnixMilli())
		}
		total++
	}
	return copies, total, nil
}

// natsDown stops the nats-server (kill: SIGKILL, else SIGTERM) for d, then
// starts it again on its port with its store.
func (r *run) natsDown(ctx context.Context, kill bool, d time.Duration) string {
	how, stop := "SIGTERM", r.nats.Stop
	if kill {
		how, stop = "SIGKILL", r.nats.Kill
	}
	if err := stop(); err != nil {
		r.problem("stop nats-server (%s): %v", how, err)
	}
	time.Sleep(d)
	if err := r.nats.Start(ctx); err != nil {
		r.problem("restart nats-server: %v", err)
	}
	return fmt.Sprintf("nats-server %s, down %s", how, d)
}
