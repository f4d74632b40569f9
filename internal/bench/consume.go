package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/consumer/natssource"
	"math"
	"math/rand/v2"
	"strconv"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/ledger"
	"github.com/tedbank/outbox/partition"
	"github.com/tedbank/outbox/transfer"
)

// Effects a consume scenario can apply (Consume's effect).
const (
	EffectLua   = "lua"   // anti-fraud: a Lua script per event in Redis (package fraud)
	EffectInbox = "inbox" // the ledger: a PostgreSQL transaction per batch with the inbox (package ledger)
)

// Consume preloads n transfer.settled entries into a stream — round(n*dup) of
// them re-adds of an earlier entry's event (a relay's duplicate), the rest
// distinct — with pipelined XADDs of 500 shaped as the relay writes them (on
// NATS, publications with their acknowledgements awaited 500 at a time), then
// runs K consumers of one group and times them until every entry is
// processed and acknowledged. The consumers apply effect: anti-fraud's Lua
// scripts in Redis, or the ledger's double entries in PostgreSQL through the
// inbox (in the scenario's database). events_per_s counts entries,
// duplicates included; the effects must then show every distinct event
// applied once, or it is an error. With baseline (Redis Streams only), the
// minimal consumer (minimal.go) then runs over as many entries of the same
// shape, preloaded the same way, for ratio_to_baseline.
func Consume(ctx context.Context, e Env, n, consumers, batch int, dup float64, effect string, baseline bool) (Result, error) {
	s, err := e.open(ctx, "consume", int32(2+2*consumers))
	if err != nil {
		return Result{}, err
	}
	defer s.close()
	stream := s.prefix + transfer.AggregateType
	dups := int(math.Round(float64(n) * dup))
	if n-dups < 1 {
		return Result{}, fmt.Errorf("want at least one distinct event, not %d duplicates of %d", dups, n)
	}
	if err := preload(ctx, s, stream, e.partitions(), n, dups); err != nil {
		return Result{}, fmt.Errorf("preload the stream: %w", err)
	}
	cs, applied, err := s.consumers(ctx, e, effect, stream, consumers, batch)
	if err != nil {
		return Result{}, err
	}
	if err := cs[0].EnsureGroup(ctx); err != nil {
		return Result{}, err
	}
	group := cs[0].Config().Group
	var wg sync.WaitGroup
	defer wg.Wait()
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	rssBefore, rssOK := startRSS()
	start := time.Now()
	for _, c := range cs {
		wg.Go(func() { _ = c.Run(cctx) })
	}
	var processed, duplicates int64
	for {
		processed, duplicates = 0, 0
		for _, c := range cs {
			st := c.Stats()
			processed += st.Processed
			duplicates += st.Duplicates
		}
		// The counters move before the batch's XACK: done when nothing is
		// left pending either.
		if processed+duplicates >= int64(n) && s.nonePending(ctx, stream, e.partitions(), group) {
			break
		}
		if err := ctx.Err(); err != nil {
			return Result{}, err
		}
		time.Sleep(2 * time.Millisecond)
	}
	took := time.Since(start)
	res := Result{Scenario: "consume", N: n, Seconds: took.Seconds(), EventsPerS: float64(n) / took.Seconds(),
		Settings: map[string]any{"consumers": consumers, "batch": batch, "duplicate_fraction": dup, "distinct": n - dups,
			"partitions": e.partitions(), "broker": s.broker(), "effect": effect}}
	stopRSS(&res, rssBefore, rssOK)
	cancel()
	wg.Wait()
	// Exactly once in effect: one effect per distinct event. The
	// consumers' own counters may count an applied event as a duplicate
	// when the reply to its effect was lost and the entry was applied again
	// (a timeout on a busy server): that is at-least-once delivery doing its
	// job, reported in duplicates.
	effects, err := applied(ctx)
	if err != nil {
		return Result{}, err
	}
	if effects != int64(n-dups) || processed+duplicates != int64(n) {
		return Result{}, fmt.Errorf("%d effects for %d distinct events (the consumers applied %d and skipped %d of %d entries)",
			effects, n-dups, processed, duplicates, n)
	}
	if duplicates != int64(dups) {
		e.Log.Warn("entries applied again after a lost reply (counted as duplicates)", "extra", duplicates-int64(dups))
	}
	res.Duplicates = ptr(duplicates)
	if baseline && s.js == nil {
		base := s.prefix + "minimal." + transfer.AggregateType
		if err := preload(ctx, s, base, e.partitions(), n, dups); err != nil {
			return Result{}, fmt.Errorf("preload the minimal consumer's stream: %w", err)
		}
		took, applied, err := minimalConsume(ctx, s.rdb, base, s.prefix, e.partitions(), n, batch)
		if err != nil {
			return Result{}, err
		}
		if applied != int64(n-dups) {
			return Result{}, fmt.Errorf("the minimal consumer applied %d of %d distinct events", applied, n-dups)
		}
		res.BaselineEventsPerS = ptr(float64(n) / took.Seconds())
		res.RatioToBaseline = ptr(res.EventsPerS / *res.BaselineEventsPerS)
	}
	return res, nil
}

// consumers makes the scenario's consumers of effect, and a function that
// counts the distinct events whose effect was applied.
func (s *space) consumers(ctx context.Context, e Env, effect, stream string, n, batch int) ([]*consumer.Consumer, func(context.Context) (int64, error), error) {
	cs := make([]*consumer.Consumer, n)
	name := func(i int) string { return fmt.Sprintf("bench-%d", i) }
	switch effect {
	case EffectLua, "":
		keys := fraud.Keys{Prefix: s.prefix + "fraud:", Partitions: e.partitions()}
		for i := range cs {
			c, err := s.newFraud(fraud.Config{Config: consumer.Config{Stream: stream, KeyPrefix: keys.Prefix, Consumer: name(i),
				BatchSize: batch, Block: 100 * time.Millisecond, Logger: e.Log, Partitions: e.partitions()}})
			if err != nil {
				return nil, nil, err
			}
			cs[i] = c.Consumer
		}
		return cs, func(ctx context.Context) (int64, error) {
			rep, err := fraud.ReadReport(ctx, s.rdb, keys)
			return rep.Verdicts, err
		}, nil
	case EffectInbox:
		if err := ledger.Migrate(ctx, s.pool); err != nil {
			return nil, nil, err
		}
		for i := range cs {
			cfg := ledger.Config{Consumer: consumer.Config{Stream: stream, KeyPrefix: s.prefix + "ledger:", Consumer: name(i),
				BatchSize: batch, Block: 100 * time.Millisecond, Logger: e.Log, Partitions: e.partitions()}}
			var err error
			if s.js != nil {
				cs[i], err = ledger.NewWithSource(s.pool, s.rdb, natssource.New(s.js), cfg)
			} else {
				cs[i], err = ledger.New(s.pool, s.rdb, cfg)
			}
			if err != nil {
				return nil, nil, err
			}
		}
		return cs, func(ctx context.Context) (int64, error) {
			var posted int64
			err := s.pool.QueryRow(ctx, "SELECT count(DISTINCT transfer_id) FROM ledger_entries").Scan(&posted)
			return posted, err
		}, nil
	}
	return nil, nil, fmt.Errorf("effect %q: want %s or %s", effect, EffectLua, EffectInbox)
}

// nonePending reports whether the group has nothing delivered and not
// acknowledged (on NATS, nor stored and not delivered) in any partition of
// stream.
func (s *space) nonePending(ctx context.Context, stream string, parts int, group string) bool {
	for p, sub := range partition.Streams(stream, parts) {
		if s.js != nil {
			cons, err := natssource.Durable(ctx, s.js, s.natsStream, group, p)
			if err != nil || cons.CachedInfo().NumAckPending != 0 || cons.CachedInfo().NumPending != 0 {
				return false
			}
			continue
		}
		p, err := s.rdb.XPending(ctx, sub, group).Result()
		if err != nil || p.Count != 0 {
			return false
		}
	}
	return true
}

// preload adds n entries, dups of them copies of an earlier entry's event,
// each to its sender's partition of stream, on the space's broker.
func preload(ctx context.Context, s *space, stream string, parts, n, dups int) error {
	if s.js != nil {
		return preloadJetStream(ctx, s.js, stream, parts, n, dups)
	}
	return preloadRedis(ctx, s.rdb, stream, parts, n, dups)
}

// entries returns n entries' fields and streams, dups of them copies of an
// earlier entry's event, each to its sender's partition of stream.
func entries(stream string, parts, n, dups int) (values [][]any, streams []string, err error) {
	isDup := make([]bool, n)
	for _, i := range rand.Perm(n - 1)[:dups] {
		isDup[i+1] = true // never the first
	}
	var (
		distinct [][]any // earlier entries' values, for the duplicates
		target   []string
		seq      int64
	)
	now := time.Now().UTC()
	for i := range n {
		if isDup[i] {
			j := rand.IntN(len(distinct))
			values, streams = append(values, distinct[j]), append(streams, target[j])
			continue
		}
		seq++
		from := rand.IntN(1000)
		ev := transfer.SettledEvent{SchemaVersion: transfer.SchemaVersion, EventID: uuid.New(), TransferID: uuid.New(),
			FromAccount: fmt.Sprintf("acct-%03d", from), ToAccount: fmt.Sprintf("acct-%03d", (from+1+rand.IntN(999))%1000),
			AmountCents: amount(), Currency: transfer.DefaultCurrency, SettledAt: now}
		payload, err := json.Marshal(ev)
		if err != nil {
			return nil, nil, err
		}
		v := []any{"event_id", ev.EventID.String(), "event_type", transfer.EventSettled,
			"aggregate_type", transfer.AggregateType, "aggregate_id", ev.TransferID.String(),
			"payload", string(payload), "headers", `{"schema_version":"1"}`,
			"occurred_at", now.Format(time.RFC3339Nano), "seq", strconv.FormatInt(seq, 10)}
		to := partition.Stream(stream, partition.Of(ev.FromAccount, parts), parts)
		distinct, target = append(distinct, v), append(target, to)
		values, streams = append(values, v), append(streams, to)
	}
	return values, streams, nil
}

// preloadRedis XADDs the entries in pipelines of 500.
func preloadRedis(ctx context.Context, rdb redis.UniversalClient, stream string, parts, n, dups int) error {
	values, streams, err := entries(stream, parts, n, dups)
	if err != nil {
		return err
	}
	pipe := rdb.Pipeline()
	for i := range values {
		pipe.XAdd(ctx, &redis.XAddArgs{Stream: streams[i], Values: values[i]})
		if pipe.Len() == 500 || i == len(values)-1 {
			if _, err := pipe.Exec(ctx); err != nil {
				return err
			}
		}
	}
	return nil
}

// preloadJetStream publishes the entries as the relay does (the payload as
// body, the other fields as headers), 500 acknowledgements awaited at a
// time; a duplicate gets a Nats-Msg-Id of its own (a re-publication past the
// duplicate window: the consumers must skip it).
func preloadJetStream(ctx context.Context, js jetstream.JetStream, stream string, parts, n, dups int) error {
	values, streams, err := entries(stream, parts, n, dups)
	if err != nil {
		return err
	}
	var futures []jetstream.PubAckFuture
	wait := func() error {
		for _, f := range futures {
			select {
			case <-f.Ok():
			case err := <-f.Err():
				return err
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		futures = futures[:0]
		return nil
	}
	for i, v := range values {
		m := &nats.Msg{Subject: streams[i], Header: nats.Header{jetstream.MsgIDHeader: {uuid.NewString()}}}
		for k := 0; k < len(v); k += 2 {
			if v[k] == "payload" {
				m.Data = []byte(v[k+1].(string))
				continue
			}
			m.Header[v[k].(string)] = []string{v[k+1].(string)}
		}
		f, err := js.PublishMsgAsync(m)
		if err != nil {
			return err
		}
		if futures = append(futures, f); len(futures) == 500 {
			if err := wait(); err != nil {
				return err
			}
		}
	}
	return wait()
}
