package consumer

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer/source"
	"github.com/tedbank/outbox/internal/outboxtest"
)

// publish appends an event of aggregate agg to stream, as the relay
// writes it (without a partition key), and returns its event id.
func publish(t *testing.T, rdb outboxtest.Redis, stream, agg string) uuid.UUID {
	return publishKeyed(t, rdb, stream, agg, "")
}

// publishKeyed is publish with partition key key ("": none written).
func publishKeyed(t *testing.T, rdb outboxtest.Redis, stream, agg, key string) uuid.UUID {
	t.Helper()
	id := uuid.New()
	values := []any{
		"event_id", id.String(), "event_type", "test.happened", "aggregate_type", "test",
		"aggregate_id", agg, "payload", `{"n":1}`, "headers", "{}", "occurred_at", time.Now().Format(time.RFC3339Nano),
	}
	if key != "" {
		values = append(values, "partition_key", key)
	}
	err := rdb.XAdd(context.Background(), &redis.XAddArgs{Stream: stream, Values: values}).Err()
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// recorder is a Handler that keeps its dedupe records and its effects (the
// aggregate ids, in the order applied) in memory, and, like an effect
// script, refuses a batch whose fence the partition's lease no longer
// holds.
type recorder struct {
	rdb     redis.Cmdable
	mu      sync.Mutex
	seen    map[uuid.UUID]bool
	applied []string
}

func newRecorder(rdb redis.Cmdable) *recorder { return &recorder{rdb: rdb, seen: map[uuid.UUID]bool{}} }

func (r *recorder) Handle(ctx context.Context, b Batch) []Result {
	res := make([]Result, len(b.Messages))
	if b.Fence != "" {
		if v, _ := r.rdb.Get(ctx, b.Keys.Lease(b.Group)).Result(); v != b.Fence {
			for i := range res {
				res[i].Err = fmt.Errorf("%w: lease holds %q", ErrFenced, v)
			}
			return res
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, m := range b.Messages {
		if r.seen[m.ID] {
			res[i].Outcome = Duplicate
			continue
		}
		r.seen[m.ID] = true
		r.applied = append(r.applied, m.AggregateID)
		res[i].Outcome = Applied
	}
	return res
}

func (r *recorder) effects() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.applied...)
}

// testConfig is a consumer of a stream of its own.
func testConfig(rdb outboxtest.Redis, name string) Config {
	return Config{Name: "test", Stream: rdb.Prefix + "stream", KeyPrefix: rdb.Prefix + "test:", Consumer: name}
}

// newGroupConsumer returns a consumer of cfg whose group exists.
func newGroupConsumer(t *testing.T, rdb outboxtest.Redis, h Handler, cfg Config) *Consumer {
	t.Helper()
	c, err := New(rdb.Client, h, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.EnsureGroup(context.Background()); err != nil {
		t.Fatal(err)
	}
	return c
}

// Two running consumers of one group under one name would share a pending
// list: the second refuses to start. One whose namesake died (not read for a
// while) starts.
func TestConsumerNameInUseIsRefused(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	cfg := testConfig(rdb, "same")
	cfg.Block = 100 * time.Millisecond
	h := newRecorder(rdb.Client)
	first, err := New(rdb.Client, h, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- first.Run(ctx) }()
	outboxtest.Eventually(t, 5*time.Second, func() bool {
		cs, err := rdb.XInfoConsumers(context.Background(), cfg.Stream, "test").Result()
		return err == nil && len(cs) == 1
	}, "first consumer never read")

	second, err := New(rdb.Client, h, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := second.Run(context.Background()); !errors.Is(err, ErrNameInUse) {
		t.Fatalf("second consumer named %q: got %v, want ErrNameInUse", cfg.Consumer, err)
	}

	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	// The namesake stopped cleanly and gave its name back: a new consumer
	// under it starts at once. (One that crashed leaves the lease to
	// expire: below.)
	ctx2, cancel2 := context.WithCancel(context.Background())
	defer cancel2()
	third, err := New(rdb.Client, h, cfg)
	if err != nil {
		t.Fatal(err)
	}
	go func() { done <- third.Run(ctx2) }()
	outboxtest.Eventually(t, 10*time.Second, func() bool { return len(done) == 0 && owns(rdb, third, 0) }, "the new consumer never took the stream")
	time.Sleep(time.Second)
	select {
	case err := <-done:
		t.Fatalf("a consumer taking over a stopped namesake's name exited: %v", err)
	default:
	}
	cancel2()
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	// A crashed namesake's lease (another token, not renewed) expires, and
	// the new consumer starts then.
	key := Keys{Prefix: cfg.KeyPrefix}.Consumer("test", cfg.Consumer)
	if err := rdb.Set(context.Background(), key, "crashed-process", 700*time.Millisecond).Err(); err != nil {
		t.Fatal(err)
	}
	fourth, err := New(rdb.Client, h, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx4, cancel4 := context.WithCancel(context.Background())
	go func() { done <- fourth.Run(ctx4) }()
	outboxtest.Eventually(t, 5*time.Second, func() bool {
		v, _ := rdb.Get(context.Background(), key).Result()
		return v == fourth.group.token
	}, "the new consumer never took over the crashed namesake's expired lease")
	cancel4()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// owns reports whether c holds the lease of partition p.
func owns(rdb outboxtest.Redis, c *Consumer, p int) bool {
	v, err := rdb.Get(context.Background(), c.parts[p].keys.Lease(c.cfg.Group)).Result()
	return err == nil && strings.HasSuffix(v, "|"+c.group.holder())
}

// A consumer that lost its partition's lease (it stalled past it, or the
// group rebalanced) applies nothing: its handler finds another lease value
// and refuses, the error says the lease is lost (the worker stops), and the
// entry stays pending for the new owner.
func TestStaleOwnerIsFenced(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	h := newRecorder(rdb.Client)
	c := newGroupConsumer(t, rdb, h, testConfig(rdb, "stale"))
	pt := c.parts[0]
	fence, err := c.group.lease(ctx, pt)
	if err != nil || fence == "" {
		t.Fatalf("lease: %q %v", fence, err)
	}
	publish(t, rdb, pt.stream, "a")
	// The lease moves on: another consumer took the partition.
	if err := rdb.Set(ctx, pt.keys.Lease("test"), "7|other|token", time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	err = readNewOnce(ctx, c, feed{part: pt, fence: fence})
	if !errors.Is(err, ErrFenced) {
		t.Fatalf("applying with a lost lease: %v, want ErrFenced", err)
	}
	if got := h.effects(); len(got) != 0 {
		t.Fatalf("effects %v applied by a consumer without the lease", got)
	}
	if p, err := rdb.XPending(ctx, pt.stream, "test").Result(); err != nil || p.Count != 1 {
		t.Fatalf("pending %+v (%v): the refused entry must stay pending", p, err)
	}
	// The lease's holder applies it.
	if err := rdb.Set(ctx, pt.keys.Lease("test"), fence, time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	if err := claimAll(ctx, c, feed{part: pt, fence: fence}); err != nil {
		t.Fatal(err)
	}
	if got := h.effects(); fmt.Sprint(got) != "[a]" {
		t.Fatalf("effects %v after the owner applied the entry, want [a]", got)
	}
}

// The previous owner of a partition, not yet aware that it lost the lease,
// can read entries after the new owner's takeover (its blocked XREADGROUP
// returns them): they stay in its pending list, fenced. The new owner applies
// them before any later entry it reads, so the partition's order holds.
func TestNewOwnerAppliesWhatTheOldOwnerReadLate(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	h := newRecorder(rdb.Client)
	c := newGroupConsumer(t, rdb, h, testConfig(rdb, "new"))
	pt := c.parts[0]
	fence, err := c.group.lease(ctx, pt)
	if err != nil || fence == "" {
		t.Fatalf("lease: %q %v", fence, err)
	}
	publish(t, rdb, pt.stream, "first")
	// The old owner's late read: the entry is delivered to it, not applied.
	if err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "test", Consumer: "old",
		Streams: []string{pt.stream, ">"}, Count: 1, Block: -1}).Err(); err != nil {
		t.Fatal(err)
	}
	publish(t, rdb, pt.stream, "second")
	if err := readNewOnce(ctx, c, feed{part: pt, fence: fence}); err != nil {
		t.Fatal(err)
	}
	if got := h.effects(); fmt.Sprint(got) != "[first second]" {
		t.Fatalf("applied %v, want [first second] (in stream order)", got)
	}
	if p, err := rdb.XPending(ctx, pt.stream, "test").Result(); err != nil || p.Count != 0 {
		t.Fatalf("pending %+v (%v), want none", p, err)
	}
}

// A consumer restarted under its own name takes its partitions back at once:
// the process that held them under that name is gone (it no longer holds
// the name), so waiting for their leases would only delay the stream.
func TestRestartedConsumerResumesItsPartitionsAtOnce(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	h := newRecorder(rdb.Client)
	cfg := testConfig(rdb, "c1")
	cfg.PartitionLease = time.Hour
	crashed, err := New(rdb.Client, h, cfg)
	if err != nil {
		t.Fatal(err)
	}
	old, err := crashed.group.lease(ctx, crashed.parts[0])
	if err != nil || old == "" {
		t.Fatalf("lease: %q %v", old, err)
	}
	restarted, _ := New(rdb.Client, h, cfg)
	v, err := restarted.group.lease(ctx, restarted.parts[0])
	if err != nil || v == "" || v == old {
		t.Fatalf("restarted consumer's lease: %q (%v), want a new epoch after %q", v, err, old)
	}
	other, _ := New(rdb.Client, h, testConfig(rdb, "c2"))
	if v, err := other.group.lease(ctx, other.parts[0]); err != nil || v != "" {
		t.Fatalf("another consumer took a live lease: %q %v", v, err)
	}
}

// A handler that replies with the wrong number of results has every message
// of the batch left pending (none is taken as done).
func TestHandlerResultsMustMatchItsBatch(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	short := HandlerFunc(func(context.Context, Batch) []Result { return []Result{{Outcome: Applied}} })
	c := newGroupConsumer(t, rdb, short, testConfig(rdb, "c1"))
	publish(t, rdb, c.parts[0].stream, "a")
	publish(t, rdb, c.parts[0].stream, "b")
	if _, err := c.stepReadNew(ctx); err == nil || !strings.Contains(err.Error(), "2 messages") {
		t.Fatalf("ReadNew: %v, want the mismatch", err)
	}
	if p, err := rdb.XPending(ctx, c.parts[0].stream, "test").Result(); err != nil || p.Count != 2 {
		t.Fatalf("pending %+v (%v), want both entries kept", p, err)
	}
}

// shortLived is a handler whose dedupe records live a minute.
type shortLived struct{ *recorder }

func (shortLived) DedupeTTL() time.Duration { return time.Minute }

func TestConfigValidate(t *testing.T) {
	ok := Config{Name: "ledger", Stream: "outbox.event.transfer"}
	if err := ok.Validate(); err != nil {
		t.Fatalf("valid config: %v", err)
	}
	for name, mutate := range map[string]func(*Config){
		"no name":       func(c *Config) { c.Name = "" },
		"metric-unsafe": func(c *Config) { c.Name = "Led-ger" },
		"no stream":     func(c *Config) { c.Stream = "" },
		"batch":         func(c *Config) { c.BatchSize = 20_000 },
		"max batch":     func(c *Config) { c.BatchSize, c.MaxBatchSize = 100, 50 },
		"lease":         func(c *Config) { c.PartitionLease = time.Second; c.Block = 2 * time.Second },
		"partitions":    func(c *Config) { c.Partitions = 100_000 },
	} {
		c := ok
		mutate(&c)
		if err := c.Validate(); !errors.Is(err, ErrConfig) {
			t.Errorf("%s: Validate = %v, want an ErrConfig", name, err)
		}
	}
	if _, err := New(redis.NewClient(&redis.Options{}), nil, ok); !errors.Is(err, ErrConfig) {
		t.Errorf("New without a handler: %v, want an ErrConfig", err)
	}
	// Dedupe records must outlive every redelivery.
	if err := ok.CheckDedupeWindow(time.Hour); !errors.Is(err, ErrConfig) {
		t.Errorf("an hour of dedupe against the relays' hour: %v, want an ErrConfig", err)
	}
	if err := ok.CheckDedupeWindow(24 * time.Hour); err != nil {
		t.Errorf("a day of dedupe: %v", err)
	}
	short := ok
	short.RelayRedelivery = 10 * time.Minute
	if err := short.CheckDedupeWindow(time.Hour); err != nil {
		t.Errorf("an hour of dedupe against relays that redeliver within 10 minutes: %v", err)
	}
	if _, err := New(redis.NewClient(&redis.Options{}), shortLived{}, ok); !errors.Is(err, ErrConfig) {
		t.Errorf("New with a handler whose records live a minute: %v, want an ErrConfig", err)
	}
}

// ownerReader is partition f's reader as its owner's worker has it once the
// partition is taken over.
func ownerReader(c *Consumer, f *feed) *streamReader {
	r := c.src.(*streams).reader(source.Partition{Group: c.cfg.Group, Subject: f.stream, N: f.n, Owner: f.fence}, newGate())
	r.takenOver = true
	f.gate = r.gate
	return r
}

// readNewOnce reads f's new entries once, as its owner's worker does, and
// applies them (after the earlier entries the read adopted).
func readNewOnce(ctx context.Context, c *Consumer, f feed) error {
	r := ownerReader(c, &f)
	msgs, err := r.readNew(ctx, c.cfg.Block, false)
	for {
		if herr := c.handle(ctx, f, r, msgs); herr != nil {
			return herr
		}
		if len(r.queue) == 0 {
			return err
		}
		msgs, r.queue = r.queue[0], r.queue[1:] // the new entries, after the earlier ones adopted
	}
}

// claimAll claims and applies every entry pending in f's partition, as a
// new owner's takeover does.
func claimAll(ctx context.Context, c *Consumer, f feed) error {
	r := ownerReader(c, &f)
	r.takenOver = false
	for !r.takenOver {
		msgs, err := r.takeOverPage(ctx)
		if err != nil {
			return err
		}
		if err := c.handle(ctx, f, r, msgs); err != nil {
			return err
		}
	}
	return nil
}

// careless applies every message it can and fails those of the aggregates
// in failing, ignoring its batch's per-key order (Order): what the
// consumer itself guarantees shows with it.
type careless struct {
	*recorder
	failing map[string]bool
}

func (h *careless) Handle(ctx context.Context, b Batch) []Result {
	res := make([]Result, len(b.Messages))
	sub := b
	sub.Messages = nil
	var at []int
	for i, m := range b.Messages {
		if h.failing[m.AggregateID] {
			res[i].Err = errors.New("store down")
			continue
		}
		sub.Messages = append(sub.Messages, m)
		at = append(at, i)
	}
	for j, r := range h.recorder.Handle(ctx, sub) {
		res[at[j]] = r
	}
	return res
}

// An entry adopted from an earlier owner goes to the handler in a batch of
// its own, before the new entries read with it: when its effect fails, the
// gate holds the later entries of its key back, whatever the handler does
// with a batch.
func TestAdoptedEntryThatFailsHoldsTheNewEntriesOfItsKey(t *testing.T) {
	t.Parallel()
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	h := &careless{recorder: newRecorder(rdb.Client), failing: map[string]bool{"first": true}}
	c := newGroupConsumer(t, rdb, h, testConfig(rdb, "new"))
	pt := c.parts[0]
	fence, err := c.group.lease(ctx, pt)
	if err != nil || fence == "" {
		t.Fatalf("lease: %q %v", fence, err)
	}
	publishKeyed(t, rdb, pt.stream, "first", "k")
	// The old owner's late read: the entry is delivered to it, not applied.
	if err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "test", Consumer: "old",
		Streams: []string{pt.stream, ">"}, Count: 1, Block: -1}).Err(); err != nil {
		t.Fatal(err)
	}
	publishKeyed(t, rdb, pt.stream, "second", "k")
	if err := readNewOnce(ctx, c, feed{part: pt, fence: fence}); !effectFailedOnly(err) {
		t.Fatalf("read: %v, want the adopted entry's effect failure", err)
	}
	if got := h.effects(); len(got) != 0 {
		t.Fatalf("applied %v while the key's earlier entry failed, want nothing", got)
	}
	// Once the store is back, the retry applies both, in order.
	h.failing = nil
	if err := c.stepProcessPending(ctx); err != nil {
		t.Fatal(err)
	}
	if got := h.effects(); fmt.Sprint(got) != "[first second]" {
		t.Fatalf("applied %v after the retry, want [first second]", got)
	}
}
