package fraud

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/internal/consumertest"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/partition"
)

// The consumers of a group divide the partitions among themselves, and
// rebalance when one joins or leaves; through all of it each sender's TEDs
// are applied once each, in the order they were published, and no partition
// is ever owned by two consumers at once.
func TestConsumersDividePartitionsAndKeepPerSenderOrder(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	const parts = 4
	stream := rdb.Prefix + "outbox.event.transfer"
	var (
		mu      sync.Mutex
		applied = map[string][]time.Time{} // per sender, settled_at in the order applied
		ids     = map[string][]string{}    // per sender, transfer ids in the order applied
		by      = map[int][]string{}       // per partition, the consumer of each effect, in order
	)
	newConsumer := func(name string) *Consumer {
		c, err := New(rdb.Client, Config{Config: consumer.Config{Stream: stream, KeyPrefix: rdb.Prefix + "fraud:", Consumer: name, Partitions: parts, Block: 50 * time.Millisecond, PartitionLease: 400 * time.Millisecond}, WindowLimitCents: 1 << 60, AmountLimitCents: 1 << 60, AuditLen: 10_000, Observer: ObserverFunc(func(ev Event, o Outcome) {
			if o == OutcomeDuplicate {
				return
			}
			mu.Lock()
			defer mu.Unlock()
			applied[ev.FromAccount] = append(applied[ev.FromAccount], ev.SettledAt)
			ids[ev.FromAccount] = append(ids[ev.FromAccount], ev.TransferID.String())
			p := partition.Of(ev.FromAccount, parts)
			by[p] = append(by[p], name)
		})})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	type running struct {
		c    *Consumer
		stop context.CancelFunc
		done chan struct{}
	}
	start := func(name string) running {
		c := newConsumer(name)
		ctx, cancel := context.WithCancel(context.Background())
		r := running{c: c, stop: cancel, done: make(chan struct{})}
		go func() {
			defer close(r.done)
			if err := c.Run(ctx); err != nil {
				t.Errorf("consumer %s: %v", name, err)
			}
		}()
		t.Cleanup(func() { cancel(); <-r.done })
		return r
	}

	// Publish a steady flow of TEDs of 20 senders, each to its partition.
	senders := make([]string, 20)
	for i := range senders {
		senders[i] = fmt.Sprintf("acct-%02d", i)
	}
	base := time.Now().UTC().Add(-time.Hour)
	published := 0
	publishSome := func(n int) {
		for range n {
			s := senders[published%len(senders)]
			publish(t, rdb, partition.Stream(stream, partition.Of(s, parts), parts), s, 100, base.Add(time.Duration(published)*time.Millisecond))
			published++
		}
	}

	// No partition is ever held by two consumers: watch the leases.
	owners := func() []string {
		out := make([]string, parts)
		for p := range parts {
			k := Keys{Prefix: rdb.Prefix + "fraud:", Partitions: parts}.Partition(p).Lease(DefaultGroup)
			v, _ := rdb.Get(context.Background(), k).Result()
			if _, rest, ok := strings.Cut(v, "|"); ok {
				out[p], _, _ = strings.Cut(rest, "|")
			}
		}
		return out
	}
	waitOwners := func(want map[string]int) {
		t.Helper()
		outboxtest.Eventually(t, 10*time.Second, func() bool {
			count := map[string]int{}
			for _, o := range owners() {
				count[o]++
			}
			return fmt.Sprint(count) == fmt.Sprint(want)
		}, "partitions never divided as %v (owners %v)", want, owners())
	}

	start("a")
	publishSome(100)
	waitOwners(map[string]int{"a": 4})
	b := start("b")
	publishSome(100)
	waitOwners(map[string]int{"a": 2, "b": 2})
	start("c")
	publishSome(100)
	waitOwners(map[string]int{"a": 2, "b": 1, "c": 1})
	b.stop() // leaves cleanly: gives its partition back and leaves the members
	<-b.done
	if _, err := rdb.ZScore(context.Background(), Keys{Prefix: rdb.Prefix + "fraud:"}.Members(DefaultGroup), "b").Result(); !errors.Is(err, redis.Nil) {
		t.Errorf("b stopped but is still among the members until its membership runs out (err %v)", err)
	}
	publishSome(100)
	waitOwners(map[string]int{"a": 2, "c": 2})

	outboxtest.Eventually(t, 20*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, ts := range applied {
			n += len(ts)
		}
		return n == published
	}, "not every TED was applied")
	mu.Lock()
	defer mu.Unlock()
	// One consumer at a time per partition: its effects change hands only
	// at the three rebalances, never back and forth.
	for p, names := range by {
		switches := 0
		for i := 1; i < len(names); i++ {
			if names[i] != names[i-1] {
				switches++
			}
		}
		if switches > 3 {
			t.Errorf("partition %d changed hands %d times in 3 rebalances: applied in two places at once (%v)", p, switches, names)
		}
	}
	for s, ts := range applied {
		if !slices.IsSortedFunc(ts, func(x, y time.Time) int { return x.Compare(y) }) {
			t.Errorf("sender %s: TEDs applied out of settled order: %v", s, ts)
		}
	}
	// The audit streams record the same effects in the same order.
	audited := map[string][]string{}
	for _, k := range (Keys{Prefix: rdb.Prefix + "fraud:", Partitions: parts}).Each() {
		msgs, err := rdb.XRange(context.Background(), k.Audit(), "-", "+").Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range msgs {
			s := m.Values["from_account"].(string)
			audited[s] = append(audited[s], m.Values["transfer_id"].(string))
		}
	}
	if fmt.Sprint(audited) != fmt.Sprint(ids) {
		t.Errorf("audit streams %v\nwant the effects as applied %v", audited, ids)
	}
	rep, err := ReadReport(context.Background(), rdb.Client, Keys{Prefix: rdb.Prefix + "fraud:", Partitions: parts})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Verdicts != int64(published) || len(rep.Accounts) != len(senders) {
		t.Fatalf("report: %d verdicts, %d senders; want %d, %d", rep.Verdicts, len(rep.Accounts), published, len(senders))
	}
}

// The effect script refuses an effect when the partition's lease no longer
// holds the batch's fence (another consumer took the partition): nothing is
// written, and the error wraps consumer.ErrFenced; with the lease's value it
// applies.
func TestEffectScriptIsFenced(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	cfg := Config{Config: consumer.Config{Stream: rdb.Prefix + "outbox.event.transfer", KeyPrefix: rdb.Prefix + "fraud:"}}.withDefaults()
	e := &effects{cfg: cfg, rdb: rdb.Client, log: cfg.Logger}
	publish(t, rdb, cfg.Stream, "ana", 100, time.Now())
	x, err := rdb.XRange(ctx, cfg.Stream, "-", "+").Result()
	if err != nil || len(x) != 1 {
		t.Fatalf("entries %v (%v)", x, err)
	}
	m, err := consumer.DecodeEntry(x[0].ID, x[0].Values)
	if err != nil {
		t.Fatal(err)
	}
	keys := Keys{Prefix: cfg.KeyPrefix}
	b := consumer.Batch{Stream: cfg.Stream, Keys: consumer.Keys{Prefix: cfg.KeyPrefix}, Group: cfg.Group,
		Fence: "3|me|token", Messages: []consumer.Message{m}}
	if err := rdb.Set(ctx, keys.Lease(cfg.Group), "7|other|token", time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	if res := e.Handle(ctx, b); !errors.Is(res[0].Err, consumer.ErrFenced) {
		t.Fatalf("applying with a lost lease: %+v, want ErrFenced", res)
	}
	if rep, _ := ReadReport(ctx, rdb.Client, keys); rep.Verdicts != 0 {
		t.Fatalf("%d verdicts written by a consumer without the lease", rep.Verdicts)
	}
	if err := rdb.Set(ctx, keys.Lease(cfg.Group), b.Fence, time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	if res := e.Handle(ctx, b); res[0].Err != nil || res[0].Outcome != "approve" {
		t.Fatalf("applying with the lease: %+v, want approve", res)
	}
	if rep, _ := ReadReport(ctx, rdb.Client, keys); rep.Verdicts != 1 {
		t.Fatalf("%d verdicts after the owner applied the entry, want 1", rep.Verdicts)
	}
}

// An entry in a partition's stream whose sender belongs to another
// partition (relay and consumer disagree on the number of partitions) is not
// applied, where its effects would land among the wrong partition's keys:
// it stays pending, with an error that says why.
func TestEntryInTheWrongPartitionStaysPending(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	stream := rdb.Prefix + "outbox.event.transfer"
	c := newGroupConsumer(t, rdb, Config{Config: consumer.Config{Stream: stream, KeyPrefix: rdb.Prefix + "fraud:", Consumer: "c1", Partitions: 2}})
	sender := "ana"
	wrong := 1 - partition.Of(sender, 2)
	publish(t, rdb, partition.Stream(stream, wrong, 2), sender, 100, time.Now())
	_, err := consumertest.ReadNew(ctx, c.Consumer)
	if err == nil || !strings.Contains(err.Error(), "disagree on the number of partitions") {
		t.Fatalf("ReadNew: %v, want the partition mismatch", err)
	}
	if p, err := rdb.XPending(ctx, partition.Stream(stream, wrong, 2), DefaultGroup).Result(); err != nil || p.Count != 1 {
		t.Fatalf("pending %+v (%v), want the entry kept", p, err)
	}
}

// An entry keyed by something other than its sender (a row written with a
// partition_key of the writer's own choosing), in the stream of the
// partition its key hashes to: the relay and this consumer agree on the
// number of partitions, and waiting cannot help. It is invalid, with the
// reason, and goes to the dead-letter stream at its MaxDeliveries-th
// delivery instead of being retried forever.
func TestEntryKeyedByAnotherThanItsSenderIsInvalid(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	const parts = 4
	stream := rdb.Prefix + "outbox.event.transfer"
	c := newGroupConsumer(t, rdb, Config{Config: consumer.Config{Stream: stream, KeyPrefix: rdb.Prefix + "fraud:", Consumer: "c1", Partitions: parts, MaxDeliveries: 2}})
	sender, key := "ana", ""
	for i := 0; key == ""; i++ { // a key of another partition than the sender's
		if k := fmt.Sprintf("t-%d", i); partition.Of(k, parts) != partition.Of(sender, parts) {
			key = k
		}
	}
	p := partition.Of(key, parts)
	publishKeyedAs(t, rdb, partition.Stream(stream, p, parts), sender, key)
	if _, err := consumertest.ReadNew(ctx, c.Consumer); err != nil { // its first delivery: kept, as invalid
		t.Fatalf("ReadNew: %v", err)
	}
	if err := consumertest.ProcessPending(ctx, c.Consumer); err != nil { // its second delivery
		t.Fatalf("ProcessPending: %v, want the entry dead-lettered", err)
	}
	keys := Keys{Prefix: rdb.Prefix + "fraud:", Partitions: parts}.Partition(p)
	dlq, err := rdb.XRange(ctx, keys.DeadLetters(), "-", "+").Result()
	if err != nil || len(dlq) != 1 {
		t.Fatalf("dead-letter stream %v (%v), want the entry", dlq, err)
	}
	if reason, _ := dlq[0].Values["dlq_reason"].(string); !strings.Contains(reason, consumer.ErrInvalid.Error()) ||
		!strings.Contains(reason, `partition_key "`+key+`"`) {
		t.Fatalf("dead letter's reason %q: want an invalid event, naming its partition_key", reason)
	}
	if p, err := rdb.XPending(ctx, partition.Stream(stream, p, parts), DefaultGroup).Result(); err != nil || p.Count != 0 {
		t.Fatalf("pending %+v (%v), want the entry acknowledged with its dead letter", p, err)
	}
}

// publishKeyedAs adds a TED of sender to stream, keyed by key.
func publishKeyedAs(t *testing.T, rdb outboxtest.Redis, stream, sender, key string) {
	t.Helper()
	id, tid := uuid.New(), uuid.New()
	p, _ := json.Marshal(map[string]any{
		"schema_version": 1, "event_id": id, "transfer_id": tid, "from_account": sender, "to_account": "dest",
		"amount_cents": 100, "currency": "BRL", "settled_at": time.Now(),
	})
	if err := rdb.XAdd(context.Background(), &redis.XAddArgs{Stream: stream, Values: []any{
		"event_id", id.String(), "event_type", "transfer.settled", "aggregate_type", "transfer",
		"aggregate_id", tid.String(), "payload", string(p), "headers", "{}",
		"occurred_at", time.Now().Format(time.RFC3339Nano), "partition_key", key,
	}}).Err(); err != nil {
		t.Fatal(err)
	}
}

// newGroupConsumer returns a consumer of cfg whose group exists.
func newGroupConsumer(t *testing.T, rdb outboxtest.Redis, cfg Config) *Consumer {
	t.Helper()
	c, err := New(rdb.Client, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.EnsureGroup(context.Background()); err != nil {
		t.Fatal(err)
	}
	return c
}

// A batch's effects run in one pipeline that nothing can stop between its
// calls: when a sender's event fails there and its next one would not (here
// the first TED's day totals have the wrong type, the next ones are of
// another day), the later ones must be held, not applied first. Another
// sender's event in the batch applies.
func TestEffectFailingInAPipelineHoldsTheSendersLaterEvents(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	cfg := Config{Config: consumer.Config{Stream: rdb.Prefix + "outbox.event.transfer", KeyPrefix: rdb.Prefix + "fraud:"}}.withDefaults()
	e := &effects{cfg: cfg, rdb: rdb.Client, log: cfg.Logger}
	yesterday := time.Now().Add(-24 * time.Hour)
	publish(t, rdb, cfg.Stream, "ana", 100, yesterday)
	publish(t, rdb, cfg.Stream, "ana", 200, time.Now())
	publish(t, rdb, cfg.Stream, "bia", 300, time.Now())
	publish(t, rdb, cfg.Stream, "ana", 400, time.Now())
	b := streamBatch(t, rdb, cfg, 4)
	keys := Keys{Prefix: cfg.KeyPrefix}
	broken := breakDayTotals(t, rdb, keys, yesterday, "ana")
	res := e.Handle(ctx, b)
	if res[0].Err == nil || !strings.Contains(res[0].Err.Error(), "WRONGTYPE") {
		t.Fatalf("ana's first TED: %+v, want WRONGTYPE", res[0])
	}
	for _, i := range []int{1, 3} {
		if res[i].Err == nil || !strings.Contains(res[i].Err.Error(), "HELD") {
			t.Errorf("ana's TED %d after the failed one: %+v, want held", i, res[i])
		}
	}
	if res[2].Err != nil || res[2].Outcome != "approve" {
		t.Errorf("bia's TED: %+v, want approve", res[2])
	}
	if rep, _ := ReadReport(ctx, rdb.Client, keys); rep.Verdicts != 1 {
		t.Fatalf("%d verdicts, want bia's only", rep.Verdicts)
	}
	// Fixed, the batch again: ana's in order, bia's a duplicate.
	if err := rdb.Del(ctx, broken).Err(); err != nil {
		t.Fatal(err)
	}
	res = e.Handle(ctx, b)
	for i, want := range []string{"approve", "approve", "duplicate", "approve"} {
		if res[i].Err != nil || res[i].Outcome != want {
			t.Errorf("again, TED %d: %+v, want %s", i, res[i], want)
		}
	}
}

// A batch longer than one call of the effect script runs as several calls
// (the first alone, the others in one pipeline once it replied): a sender's
// event that fails in the first call holds the
// sender's later events in the next (Handle leaves them out of it, and the
// batch's gate would refuse them), while the others' apply; once fixed, the
// batch applies in order.
func TestEffectFailingInOneCallHoldsTheSendersEventsInTheNext(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	cfg := Config{Config: consumer.Config{Stream: rdb.Prefix + "outbox.event.transfer", KeyPrefix: rdb.Prefix + "fraud:"}}.withDefaults()
	e := &effects{cfg: cfg, rdb: rdb.Client, log: cfg.Logger}
	yesterday := time.Now().Add(-24 * time.Hour)
	n := effectsPerCall + 20
	publish(t, rdb, cfg.Stream, "ana", 100, yesterday)
	for i := 1; i < n-1; i++ {
		publish(t, rdb, cfg.Stream, fmt.Sprintf("s%03d", i), 100, time.Now())
	}
	publish(t, rdb, cfg.Stream, "ana", 200, time.Now()) // in the second call
	b := streamBatch(t, rdb, cfg, n)
	keys := Keys{Prefix: cfg.KeyPrefix}
	broken := breakDayTotals(t, rdb, keys, yesterday, "ana")
	res := e.Handle(ctx, b)
	if res[0].Err == nil || !strings.Contains(res[0].Err.Error(), "WRONGTYPE") {
		t.Fatalf("ana's first TED: %+v, want WRONGTYPE", res[0])
	}
	if last := res[n-1]; !errors.Is(last.Err, consumer.ErrHeld) && (last.Err == nil || !strings.Contains(last.Err.Error(), "HELD")) {
		t.Fatalf("ana's TED in the next call: %+v, want held", last)
	}
	for i := 1; i < n-1; i++ {
		if res[i].Err != nil || res[i].Outcome != "approve" {
			t.Fatalf("TED %d of another sender: %+v, want approve", i, res[i])
		}
	}
	if err := rdb.Del(ctx, broken).Err(); err != nil {
		t.Fatal(err)
	}
	res = e.Handle(ctx, b)
	if res[0].Outcome != "approve" || res[n-1].Outcome != "approve" || res[1].Outcome != "duplicate" {
		t.Fatalf("again: ana's %+v and %+v, another's %+v; want approve, approve, duplicate", res[0], res[n-1], res[1])
	}
	if rep, _ := ReadReport(ctx, rdb.Client, keys); rep.Verdicts != int64(n) {
		t.Fatalf("%d verdicts, want %d", rep.Verdicts, n)
	}
}

// pipelineHook is a redis.Hook that changes pipelines only.
type pipelineHook func(next redis.ProcessPipelineHook) redis.ProcessPipelineHook

func (h pipelineHook) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (h pipelineHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (h pipelineHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return h(next)
}

// failFirstScripts fails the first pipeline of script calls it sees, before
// sending it, as a connection that broke would.
func failFirstScripts() pipelineHook {
	var failed atomic.Bool
	return func(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
		return func(ctx context.Context, cmds []redis.Cmder) error {
			if len(cmds) > 0 && cmds[0].Name() == "evalsha" && failed.CompareAndSwap(false, true) {
				err := errors.New("connection reset (injected)")
				for _, c := range cmds {
					c.SetErr(err)
				}
				return err
			}
			return next(ctx, cmds)
		}
	}
}

// A call that fails whole, before its script could record anything in the
// batch's gate (here its connection broke): the senders of its events have
// their events in the later calls of the batch held, not applied first.
func TestEffectCallFailingWholeHoldsItsSendersInTheNextCall(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	cfg := Config{Config: consumer.Config{Stream: rdb.Prefix + "outbox.event.transfer", KeyPrefix: rdb.Prefix + "fraud:"}}.withDefaults()
	rdb.AddHook(failFirstScripts())
	e := &effects{cfg: cfg, rdb: rdb.Client, log: cfg.Logger}
	n := effectsPerCall + 20
	publish(t, rdb, cfg.Stream, "ana", 100, time.Now())
	for i := 1; i < n-1; i++ {
		publish(t, rdb, cfg.Stream, fmt.Sprintf("s%03d", i), 100, time.Now())
	}
	publish(t, rdb, cfg.Stream, "ana", 200, time.Now()) // in the second call
	b := streamBatch(t, rdb, cfg, n)
	res := e.Handle(ctx, b)
	if res[0].Err == nil || !strings.Contains(res[0].Err.Error(), "injected") {
		t.Fatalf("ana's first TED: %+v, want the injected error", res[0])
	}
	if last := res[n-1]; !errors.Is(last.Err, consumer.ErrHeld) {
		t.Fatalf("ana's TED in the next call: %+v, want held", last)
	}
	if r := res[effectsPerCall]; r.Err != nil || r.Outcome != "approve" {
		t.Fatalf("another sender's TED in the next call: %+v, want approve", r)
	}
}

// streamBatch returns one batch of the n entries of cfg's stream, in order,
// as the consumer hands them to the effect.
func streamBatch(t *testing.T, rdb outboxtest.Redis, cfg Config, n int) consumer.Batch {
	t.Helper()
	b := consumer.Batch{Stream: cfg.Stream, Keys: consumer.Keys{Prefix: cfg.KeyPrefix}, Group: cfg.Group}
	for _, one := range entryBatches(t, rdb, cfg, n) {
		b.Messages = append(b.Messages, one.Messages...)
	}
	return b
}

// breakDayTotals gives sender's totals of at's day the wrong type, and
// returns their key.
func breakDayTotals(t *testing.T, rdb outboxtest.Redis, keys Keys, at time.Time, sender string) string {
	t.Helper()
	day, _ := Day(at)
	key := keys.DayAccount(day, sender)
	if err := rdb.Set(context.Background(), key, "not a hash", time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	return key
}

// refuseFirstOfPipeline makes Redis refuse the first call of the first
// pipeline of several script calls it sees, before the script writes
// anything (one key fewer than the call's arguments say), as a call refused
// for memory would be, while the calls after it in the pipeline reach Redis
// unchanged.
func refuseFirstOfPipeline() pipelineHook {
	var refused atomic.Bool
	return func(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
		return func(ctx context.Context, cmds []redis.Cmder) error {
			if len(cmds) > 1 && cmds[0].Name() == "evalsha" && refused.CompareAndSwap(false, true) {
				args := cmds[0].Args() // evalsha, sha, numkeys, keys..., args...
				args[2] = args[2].(int) - 1
			}
			return next(ctx, cmds)
		}
	}
}

// The calls of a batch after its first go in one pipeline: one that Redis
// refuses whole (before its script ran) must not let the next one run, or a
// sender with an event in each would have its later one applied first.
// The next call holds all its events; the batch, handled again, applies in
// order.
func TestEffectCallRefusedInAPipelineHoldsTheCallsAfterIt(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	cfg := Config{Config: consumer.Config{Stream: rdb.Prefix + "outbox.event.transfer", KeyPrefix: rdb.Prefix + "fraud:"}, AuditLen: 1000}.withDefaults()
	rdb.AddHook(refuseFirstOfPipeline())
	e := &effects{cfg: cfg, rdb: rdb.Client, log: cfg.Logger}
	n := 2*effectsPerCall + 20
	ana := []int{effectsPerCall + 50, n - 1} // in the second call and in the third
	var anas []string                        // her transfers, in order
	for i := range n {
		from := fmt.Sprintf("s%03d", i)
		if slices.Contains(ana, i) {
			from = "ana"
		}
		if id := publish(t, rdb, cfg.Stream, from, 100, time.Now()); from == "ana" {
			anas = append(anas, id.String())
		}
	}
	b := streamBatch(t, rdb, cfg, n)
	res := e.Handle(ctx, b)
	for i, r := range res {
		switch {
		case i < effectsPerCall: // the first call, alone in its pipeline
			if r.Err != nil || r.Outcome != "approve" {
				t.Fatalf("TED %d in the first call: %+v, want approve", i, r)
			}
		case i < 2*effectsPerCall: // the refused one
			if r.Err == nil || !strings.Contains(r.Err.Error(), "effect script called with") {
				t.Fatalf("TED %d in the refused call: %+v, want its refusal", i, r)
			}
		default: // the call after it: held, not failed
			if !errors.Is(r.Err, consumer.ErrHeld) || !strings.Contains(r.Err.Error(), "HELD call 2 of this batch did not run") {
				t.Fatalf("TED %d in the call after the refused one: %+v, want held", i, r)
			}
		}
	}
	res = e.Handle(ctx, b)
	for i, r := range res {
		want := "approve"
		if i < effectsPerCall {
			want = "duplicate"
		}
		if r.Err != nil || r.Outcome != want {
			t.Fatalf("again, TED %d: %+v, want %s", i, r, want)
		}
	}
	// ana's two TEDs took effect in their order (the audit stream lists the
	// effects in the order applied).
	audit, err := rdb.XRange(ctx, Keys{Prefix: cfg.KeyPrefix}.Audit(), "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	var applied []string
	for _, x := range audit {
		if x.Values["from_account"] == "ana" {
			applied = append(applied, x.Values["transfer_id"].(string))
		}
	}
	if !slices.Equal(applied, anas) {
		t.Fatalf("ana's TEDs applied in the order %v, want %v", applied, anas)
	}
}

// An event without a partition key (an entry written before relays wrote
// one) that fails holds every later event, of any sender (consumer.Order):
// the script's gate holds only senders, so a pipeline of calls ends at the
// call with such an event, and the calls after it wait for its reply.
func TestUnkeyedEventFailingHoldsTheLaterCalls(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	cfg := Config{Config: consumer.Config{Stream: rdb.Prefix + "outbox.event.transfer", KeyPrefix: rdb.Prefix + "fraud:"}}.withDefaults()
	e := &effects{cfg: cfg, rdb: rdb.Client, log: cfg.Logger}
	n := 3*effectsPerCall + 20
	unkeyed := effectsPerCall + 10 // in the second call, the first of the pipeline
	yesterday := time.Now().Add(-24 * time.Hour)
	for i := range n {
		if i != unkeyed {
			publish(t, rdb, cfg.Stream, fmt.Sprintf("s%03d", i), 100, time.Now())
			continue
		}
		id, tid := uuid.New(), uuid.New()
		p, _ := json.Marshal(map[string]any{"schema_version": 1, "event_id": id, "transfer_id": tid, "from_account": "old",
			"to_account": "dest", "amount_cents": 100, "currency": "BRL", "settled_at": yesterday})
		if err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: cfg.Stream, Values: []any{
			"event_id", id.String(), "event_type", "transfer.settled", "aggregate_type", "transfer",
			"aggregate_id", tid.String(), "payload", string(p), "headers", "{}", "occurred_at", yesterday.Format(time.RFC3339Nano),
		}}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	b := streamBatch(t, rdb, cfg, n)
	if b.Messages[unkeyed].Key != "" {
		t.Fatalf("event %d has key %q, want none", unkeyed, b.Messages[unkeyed].Key)
	}
	breakDayTotals(t, rdb, Keys{Prefix: cfg.KeyPrefix}, yesterday, "old")
	res := e.Handle(ctx, b)
	for i, r := range res {
		switch {
		case i == unkeyed:
			if r.Err == nil || !strings.Contains(r.Err.Error(), "WRONGTYPE") {
				t.Fatalf("the unkeyed TED: %+v, want WRONGTYPE", r)
			}
		case i < 2*effectsPerCall: // the first call, and the rest of the unkeyed one's
			if r.Err != nil || r.Outcome != "approve" {
				t.Fatalf("TED %d: %+v, want approve", i, r)
			}
		default: // every later call
			if !errors.Is(r.Err, consumer.ErrHeld) {
				t.Fatalf("TED %d, after the unkeyed one failed: %+v, want held", i, r)
			}
		}
	}
}
