package fraud

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

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
		c, err := New(rdb.Client, Config{
			Stream: stream, KeyPrefix: rdb.Prefix + "fraud:", Consumer: name, Partitions: parts,
			Block: 50 * time.Millisecond, PartitionLease: 400 * time.Millisecond,
			WindowLimitCents: 1 << 60, AmountLimitCents: 1 << 60, AuditLen: 10_000,
			Observer: ObserverFunc(func(ev Event, o Outcome) {
				if o == OutcomeDuplicate {
					return
				}
				mu.Lock()
				defer mu.Unlock()
				applied[ev.FromAccount] = append(applied[ev.FromAccount], ev.SettledAt)
				ids[ev.FromAccount] = append(ids[ev.FromAccount], ev.TransferID.String())
				p := partition.Of(ev.FromAccount, parts)
				by[p] = append(by[p], name)
			}),
		})
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

// A consumer that lost its partition's lease (it stalled past it, or the
// group rebalanced) cannot apply an effect: the effect script finds another
// lease value and refuses, and the entry stays pending for the new owner.
func TestStaleOwnerIsFenced(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	stream := rdb.Prefix + "outbox.event.transfer"
	c := newGroupConsumer(t, rdb, Config{Stream: stream, KeyPrefix: rdb.Prefix + "fraud:", Consumer: "stale"})
	pt := c.parts[0]
	fence, err := c.lease(ctx, pt)
	if err != nil || fence == "" {
		t.Fatalf("lease: %q %v", fence, err)
	}
	publish(t, rdb, stream, "ana", 100, time.Now())
	// The lease moves on: another consumer took the partition.
	if err := rdb.Set(ctx, pt.keys.Lease(DefaultGroup), "7|other|token", time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	_, err = c.readNew(ctx, feed{part: pt, fence: fence})
	if !errors.Is(err, errFenced) {
		t.Fatalf("applying with a lost lease: %v, want errFenced", err)
	}
	if rep, _ := ReadReport(ctx, rdb.Client, Keys{Prefix: rdb.Prefix + "fraud:"}); rep.Verdicts != 0 {
		t.Fatalf("%d verdicts written by a consumer without the lease", rep.Verdicts)
	}
	if p, err := rdb.XPending(ctx, stream, DefaultGroup).Result(); err != nil || p.Count != 1 {
		t.Fatalf("pending %+v (%v): the refused entry must stay pending", p, err)
	}
	// The lease's holder applies it.
	if err := rdb.Set(ctx, pt.keys.Lease(DefaultGroup), fence, time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.claim(ctx, feed{part: pt, fence: fence}, 0); err != nil {
		t.Fatal(err)
	}
	if rep, _ := ReadReport(ctx, rdb.Client, Keys{Prefix: rdb.Prefix + "fraud:"}); rep.Verdicts != 1 {
		t.Fatalf("%d verdicts after the owner applied the entry, want 1", rep.Verdicts)
	}
}

// The previous owner of a partition, not yet aware that it lost the lease,
// can read entries after the new owner's takeover (its blocked XREADGROUP
// returns them): they stay in its pending list, fenced. The new owner applies
// them before any later entry it reads, so the sender's order holds.
func TestNewOwnerAppliesWhatTheOldOwnerReadLate(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	stream := rdb.Prefix + "outbox.event.transfer"
	c := newGroupConsumer(t, rdb, Config{Stream: stream, KeyPrefix: rdb.Prefix + "fraud:", Consumer: "new", AuditLen: 100})
	pt := c.parts[0]
	fence, err := c.lease(ctx, pt)
	if err != nil || fence == "" {
		t.Fatalf("lease: %q %v", fence, err)
	}
	first := publish(t, rdb, stream, "ana", 100, time.Now())
	// The old owner's late read: the entry is delivered to it, not applied.
	if err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: DefaultGroup, Consumer: "old",
		Streams: []string{stream, ">"}, Count: 1, Block: -1}).Err(); err != nil {
		t.Fatal(err)
	}
	second := publish(t, rdb, stream, "ana", 200, time.Now())
	if _, err := c.readNew(ctx, feed{part: pt, fence: fence}); err != nil {
		t.Fatal(err)
	}
	msgs, err := rdb.XRange(ctx, pt.keys.Audit(), "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	var applied []string
	for _, m := range msgs {
		applied = append(applied, m.Values["transfer_id"].(string))
	}
	if want := []string{first.String(), second.String()}; fmt.Sprint(applied) != fmt.Sprint(want) {
		t.Fatalf("applied %v, want %v (in settled order)", applied, want)
	}
	if p, err := rdb.XPending(ctx, stream, DefaultGroup).Result(); err != nil || p.Count != 0 {
		t.Fatalf("pending %+v (%v), want none", p, err)
	}
}

// A consumer restarted under its own name takes its partitions back at once:
// the process that held them under that name is gone (it no longer holds
// the name), so waiting for their leases would only delay the stream.
func TestRestartedConsumerResumesItsPartitionsAtOnce(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	cfg := Config{Stream: rdb.Prefix + "s", KeyPrefix: rdb.Prefix + "fraud:", Consumer: "c1", PartitionLease: time.Hour}
	crashed, err := New(rdb.Client, cfg)
	if err != nil {
		t.Fatal(err)
	}
	old, err := crashed.lease(ctx, crashed.parts[0])
	if err != nil || old == "" {
		t.Fatalf("lease: %q %v", old, err)
	}
	restarted, _ := New(rdb.Client, cfg)
	v, err := restarted.lease(ctx, restarted.parts[0])
	if err != nil || v == "" || v == old {
		t.Fatalf("restarted consumer's lease: %q (%v), want a new epoch after %q", v, err, old)
	}
	other, _ := New(rdb.Client, Config{Stream: cfg.Stream, KeyPrefix: cfg.KeyPrefix, Consumer: "c2"})
	if v, err := other.lease(ctx, other.parts[0]); err != nil || v != "" {
		t.Fatalf("another consumer took a live lease: %q %v", v, err)
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
	c := newGroupConsumer(t, rdb, Config{Stream: stream, KeyPrefix: rdb.Prefix + "fraud:", Consumer: "c1", Partitions: 2})
	sender := "ana"
	wrong := 1 - partition.Of(sender, 2)
	publish(t, rdb, partition.Stream(stream, wrong, 2), sender, 100, time.Now())
	_, err := c.ReadNew(ctx)
	if err == nil || !strings.Contains(err.Error(), "disagree on the number of partitions") {
		t.Fatalf("ReadNew: %v, want the partition mismatch", err)
	}
	if p, err := rdb.XPending(ctx, partition.Stream(stream, wrong, 2), DefaultGroup).Result(); err != nil || p.Count != 1 {
		t.Fatalf("pending %+v (%v), want the entry kept", p, err)
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
