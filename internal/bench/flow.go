package bench

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/partition"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/relay/redisbroker"
	"github.com/tedbank/outbox/transfer"
)

// flow is one relay (default configuration but for its stream prefix) and one
// anti-fraud consumer running on a space, recording when each event was
// committed (Settle returned), first seen in the stream (by a separate XREAD
// reader, when asked for) and first judged by the consumer. A minimal flow
// (startMinimalFlow) runs the minimal relay instead, next to the same
// consumer: on 2 cores the consumer's work competes with the relay's, so a
// baseline without it would be measured on a quieter machine.
type flow struct {
	s        *space
	relay    *relay.Relay
	minimal  *minimalRelay
	consumer *fraud.Consumer
	reader   bool
	errs     atomic.Int64

	mu                          sync.Mutex
	committed, inStream, judged map[uuid.UUID]time.Time

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

func startFlow(ctx context.Context, e Env, s *space, reader bool) (*flow, error) {
	f := &flow{s: s, reader: reader, committed: map[uuid.UUID]time.Time{},
		inStream: map[uuid.UUID]time.Time{}, judged: map[uuid.UUID]time.Time{}}
	stream := s.prefix + transfer.AggregateType
	var err error
	rp, err := s.relayPool(ctx)
	if err != nil {
		return nil, err
	}
	f.relay, err = s.newRelay(rp, relay.Config{Name: "bench", StreamPrefix: s.prefix, Logger: e.Log, Ownership: e.Ownership,
		Partitions: e.partitions(), BusyRows: e.BusyRows}, redisbroker.Config{MinReplicas: e.MinReplicas})
	if err != nil {
		return nil, err
	}
	if err := f.startConsumer(ctx, e, stream); err != nil {
		return nil, err
	}
	f.ctx, f.cancel = context.WithCancel(ctx)
	if err := f.startReaders(e, stream); err != nil {
		f.stop()
		return nil, err
	}
	f.wg.Go(func() { _ = f.relay.Run(f.ctx) })
	f.runConsumer()
	// The timed phase starts once the relay has started up: it listens,
	// and its first drain has made a claim (for a partition owner, after
	// it took its leases: about 100 ms on the 2-core machine, which put
	// the first 20 events of a 2,000-event run, its whole p99, in the
	// start-up). A relay's start is rare; the figures are its steady state.
	deadline := time.Now().Add(30 * time.Second)
	for st := f.relay.Stats(); !st.ListenUp || st.Claims == 0; st = f.relay.Stats() {
		if err := f.ctx.Err(); err != nil {
			f.stop()
			return nil, err
		}
		if time.Now().After(deadline) {
			f.stop()
			return nil, fmt.Errorf("bench: the relay did not start within 30s (listening %t, claims %d)", st.ListenUp, st.Claims)
		}
		time.Sleep(time.Millisecond)
	}
	return f, nil
}

// startMinimalFlow starts the minimal relay (minimalrelay.go) and the
// stream reader on a space of Redis Streams whose notify mode always
// notifies.
func startMinimalFlow(ctx context.Context, e Env, s *space) (*flow, error) {
	f := &flow{s: s, reader: true, committed: map[uuid.UUID]time.Time{},
		inStream: map[uuid.UUID]time.Time{}, judged: map[uuid.UUID]time.Time{}}
	rp, err := s.relayPool(ctx)
	if err != nil {
		return nil, err
	}
	f.minimal = &minimalRelay{pool: rp, rdb: s.rdb, prefix: s.prefix, parts: e.partitions()}
	stream := s.prefix + transfer.AggregateType
	if err := f.startConsumer(ctx, e, stream); err != nil {
		return nil, err
	}
	f.ctx, f.cancel = context.WithCancel(ctx)
	if err := f.startReaders(e, stream); err != nil {
		f.stop()
		return nil, err
	}
	f.runConsumer()
	f.wg.Go(func() {
		if err := f.minimal.run(f.ctx); err != nil {
			e.Log.Error("minimal relay", "error", err)
		}
	})
	for !f.minimal.listening.Load() {
		if err := f.ctx.Err(); err != nil {
			f.stop()
			return nil, err
		}
		time.Sleep(time.Millisecond)
	}
	return f, nil
}

// startConsumer makes the flow's anti-fraud consumer and its group
// (runConsumer starts it).
func (f *flow) startConsumer(ctx context.Context, e Env, stream string) error {
	var err error
	f.consumer, err = f.s.newFraud(fraud.Config{
		Config: consumer.Config{Stream: stream, KeyPrefix: f.s.prefix + "fraud:", Consumer: "bench",
			Block: 200 * time.Millisecond, Logger: e.Log, Partitions: e.partitions()},
		MinReplicas: e.MinReplicas,
		Observer: fraud.ObserverFunc(func(ev fraud.Event, _ fraud.Outcome) {
			now := time.Now()
			f.mu.Lock()
			if _, seen := f.judged[ev.EventID]; !seen {
				f.judged[ev.EventID] = now
			}
			f.mu.Unlock()
		})})
	if err != nil {
		return err
	}
	return f.consumer.EnsureGroup(ctx)
}

// runConsumer runs the flow's consumer until the flow stops.
func (f *flow) runConsumer() {
	f.wg.Go(func() { _ = f.consumer.Run(f.ctx) })
}

// startReaders starts the stream readers, when the flow has them.
func (f *flow) startReaders(e Env, stream string) error {
	if f.reader {
		// Blocking XREADs from the start of each partition's stream,
		// matching event ids.
		for _, stream := range partition.Streams(stream, e.partitions()) {
			if f.s.js != nil {
				if err := f.subscribe(stream); err != nil {
					return err
				}
				continue
			}
			f.wg.Go(func() { f.read(f.s.rdb, stream) })
		}
	}
	return nil
}

func (f *flow) stop() {
	f.cancel()
	f.wg.Wait()
}

// settle settles one random TED and records its commit time.
func (f *flow) settle() {
	from := rand.IntN(1000)
	t := transfer.Transfer{ID: uuid.New(), FromAccount: fmt.Sprintf("acct-%03d", from),
		ToAccount: fmt.Sprintf("acct-%03d", (from+1+rand.IntN(999))%1000), AmountCents: amount()}
	res, err := transfer.Settle(f.ctx, f.s.pool, t)
	now := time.Now()
	if err != nil {
		if f.ctx.Err() == nil {
			f.errs.Add(1)
		}
		return
	}
	f.mu.Lock()
	f.committed[res.EventID] = now
	f.mu.Unlock()
}

// wait waits until every committed event was judged (and seen by the reader),
// for at most timeout.
func (f *flow) wait(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		f.mu.Lock()
		c, s, j := len(f.committed), len(f.inStream), len(f.judged)
		f.mu.Unlock()
		if (j >= c || f.consumer == nil) && (!f.reader || s >= c) {
			return nil
		}
		if time.Now().After(deadline) {
			if f.reader {
				return fmt.Errorf("after %s only %d of %d events reached the stream and %d anti-fraud", timeout, s, c, j)
			}
			return fmt.Errorf("after %s only %d of %d events reached anti-fraud", timeout, j, c)
		}
		if err := f.ctx.Err(); err != nil {
			return err
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// latencies returns commit → stream entry and commit → verdict of every
// committed event.
func (f *flow) latencies() (toStream, toVerdict []time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for id, at := range f.committed {
		if t, ok := f.inStream[id]; ok {
			toStream = append(toStream, t.Sub(at))
		}
		if t, ok := f.judged[id]; ok {
			toVerdict = append(toVerdict, t.Sub(at))
		}
	}
	return toStream, toVerdict
}

// openLoop calls fn n times on its own goroutine each, the i-th at start +
// i/rate whatever the earlier calls are doing (an open-loop schedule: a slow
// commit delays no other TED), and waits for them. It returns how late the
// schedule started a call at worst.
func openLoop(ctx context.Context, rate float64, n int, fn func()) (maxLag time.Duration, err error) {
	var wg sync.WaitGroup
	defer wg.Wait()
	timer := time.NewTimer(0)
	defer timer.Stop()
	<-timer.C
	start := time.Now()
	for i := range n {
		at := start.Add(time.Duration(float64(i) / rate * float64(time.Second)))
		if d := time.Until(at); d > 0 {
			timer.Reset(d)
			select {
			case <-ctx.Done():
				return maxLag, ctx.Err()
			case <-timer.C:
			}
		}
		maxLag = max(maxLag, time.Since(at))
		if err := ctx.Err(); err != nil {
			return maxLag, err
		}
		wg.Go(fn)
	}
	return maxLag, nil
}

// amount draws a TED's amount: 1% above anti-fraud's single-TED limit (sent
// to review, with an alert), the rest up to R$ 2.000, so that the review path
// is a small share and the velocity rule (R$ 100.000 per sender and hour, 1000
// senders) seldom trips.
func amount() int64 {
	if rand.IntN(100) == 0 {
		return fraud.DefaultAmountLimitCents + 1 + rand.Int64N(1_000_000)
	}
	return 1 + rand.Int64N(200_000)
}

// modeName is the notify mode a run used: empty means the migrations' default.
func modeName(mode string) string {
	if mode == "" {
		return "default"
	}
	return mode
}

var errNoEvents = errors.New("no TED was settled")

// read records when each event first appears in stream.
func (f *flow) read(rdb redis.Cmdable, stream string) {
	last := "0"
	for f.ctx.Err() == nil {
		res, err := rdb.XRead(f.ctx, &redis.XReadArgs{Streams: []string{stream, last}, Count: 1000, Block: 200 * time.Millisecond}).Result()
		if err != nil || len(res) == 0 {
			continue
		}
		now := time.Now()
		f.mu.Lock()
		for _, m := range res[0].Messages {
			last = m.ID
			raw, _ := m.Values["event_id"].(string)
			if id, err := uuid.Parse(raw); err == nil {
				if _, seen := f.inStream[id]; !seen {
					f.inStream[id] = now
				}
			}
		}
		f.mu.Unlock()
	}
}

// subscribe records when each event first appears on a NATS subject (a
// plain subscription: it sees each message as JetStream stores it).
func (f *flow) subscribe(subject string) error {
	sub, err := f.s.js.Conn().Subscribe(subject, func(m *nats.Msg) {
		now := time.Now()
		id, err := uuid.Parse(m.Header.Get("event_id"))
		if err != nil {
			return
		}
		f.mu.Lock()
		if _, seen := f.inStream[id]; !seen {
			f.inStream[id] = now
		}
		f.mu.Unlock()
	})
	if err != nil {
		return fmt.Errorf("subscribe to %s: %w", subject, err)
	}
	f.wg.Go(func() {
		<-f.ctx.Done()
		_ = sub.Unsubscribe()
	})
	return nil
}
