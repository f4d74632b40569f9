package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/consumer/inbox"
	"github.com/tedbank/outbox/internal/consumertest"
	"github.com/tedbank/outbox/internal/outboxtest"
)

func TestMain(m *testing.M) { outboxtest.MainWithExamples(m, "example.inbox.") }

// env is a consumer's own database (migrated for the inbox, with a table
// of effects) and a stream of its own.
type env struct {
	t      *testing.T
	ctx    context.Context
	db     *pgxpool.Pool
	rdb    outboxtest.Redis
	stream string
}

func newEnv(t *testing.T) *env {
	t.Helper()
	e := &env{t: t, ctx: context.Background(), db: outboxtest.Postgres(t), rdb: outboxtest.NewRedis(t)}
	e.stream = e.rdb.Prefix + "outbox.event.thing"
	if _, err := inbox.Migrate(e.ctx, e.db); err != nil {
		t.Fatal(err)
	}
	if _, err := e.db.Exec(e.ctx, `CREATE TABLE effects (event_id uuid NOT NULL, aggregate_id text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return e
}

// publish appends events, as the relay writes them, and returns their ids;
// an id given twice is published twice (a relay's re-publication).
func (e *env) publish(aggs ...string) []uuid.UUID {
	e.t.Helper()
	ids := make([]uuid.UUID, len(aggs))
	for i, agg := range aggs {
		ids[i] = uuid.New()
		e.xadd(ids[i], agg)
	}
	return ids
}

func (e *env) xadd(id uuid.UUID, agg string) { e.xaddKey(id, agg, agg) }

// xaddKey appends an event of aggregate agg with partition key key.
func (e *env) xaddKey(id uuid.UUID, agg, key string) {
	e.t.Helper()
	err := e.rdb.XAdd(e.ctx, &redis.XAddArgs{Stream: e.stream, Values: []any{
		"event_id", id.String(), "event_type", "thing.happened", "aggregate_type", "thing",
		"aggregate_id", agg, "payload", `{}`, "headers", "{}", "partition_key", key,
	}}).Err()
	if err != nil {
		e.t.Fatal(err)
	}
}

// record is the handler: one effects row per application; an aggregate
// named in fail fails with that error.
func record(fail map[string]error) inbox.Handler {
	return inbox.HandlerFunc(func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if err := fail[m.AggregateID]; err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, aggregate_id) VALUES ($1, $2)`, m.ID, m.AggregateID)
		return err
	})
}

func (e *env) consumer(h inbox.Handler, mutate func(*consumer.Config)) *consumer.Consumer {
	e.t.Helper()
	in, err := inbox.New(e.db, h, inbox.Config{})
	if err != nil {
		e.t.Fatal(err)
	}
	cfg := consumer.Config{Name: "things", Stream: e.stream, KeyPrefix: e.rdb.Prefix + "things:", Consumer: "c1",
		MaxDeliveries: 2}
	if mutate != nil {
		mutate(&cfg)
	}
	c, err := consumer.New(e.rdb.Client, in, cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	if err := c.EnsureGroup(e.ctx); err != nil {
		e.t.Fatal(err)
	}
	return c
}

// effects counts the effects rows of each event.
func (e *env) effects() map[uuid.UUID]int {
	e.t.Helper()
	rows, _ := e.db.Query(e.ctx, `SELECT event_id FROM effects`)
	got := map[uuid.UUID]int{}
	var id uuid.UUID
	if _, err := pgx.ForEachRow(rows, []any{&id}, func() error { got[id]++; return nil }); err != nil {
		e.t.Fatal(err)
	}
	return got
}

func (e *env) pending() int64 {
	e.t.Helper()
	p, err := e.rdb.XPending(e.ctx, e.stream, "things").Result()
	if err != nil {
		e.t.Fatal(err)
	}
	return p.Count
}

// A redelivered event (published twice, or read again) finds its id in the
// inbox: its effect is applied once, and every delivery is acknowledged.
func TestEachEffectAppliedOnce(t *testing.T) {
	e := newEnv(t)
	ids := e.publish("a", "b", "c")
	e.xadd(ids[1], "b") // published again, in another batch
	c := e.consumer(record(nil), nil)
	if _, err := consumertest.ReadNew(e.ctx, c); err != nil {
		t.Fatal(err)
	}
	e.xadd(ids[0], "a")
	e.xadd(ids[2], "c")
	if _, err := consumertest.ReadNew(e.ctx, c); err != nil {
		t.Fatal(err)
	}
	got := e.effects()
	for _, id := range ids {
		if got[id] != 1 {
			t.Errorf("event %s applied %d times, want once (effects %v)", id, got[id], got)
		}
	}
	if st := c.Stats(); st.Processed != 3 || st.Duplicates != 3 {
		t.Errorf("stats %+v, want 3 processed, 3 duplicates", st)
	}
	if n := e.pending(); n != 0 {
		t.Errorf("%d entries pending, want none", n)
	}
}

// The same event twice in one batch is applied once.
func TestDuplicateInOneBatch(t *testing.T) {
	e := newEnv(t)
	id := uuid.New()
	e.xadd(id, "a")
	e.xadd(id, "a")
	c := e.consumer(record(nil), nil)
	if _, err := consumertest.ReadNew(e.ctx, c); err != nil {
		t.Fatal(err)
	}
	if got := e.effects(); got[id] != 1 {
		t.Fatalf("applied %d times, want once", got[id])
	}
}

// A message whose handler fails does not hold the others back: they are
// applied (each in a transaction of its own) and acknowledged; it stays
// pending, and one that can never be applied (consumer.ErrInvalid) moves to
// the dead-letter stream at its last delivery, with no effect and no inbox
// row. A BatchHandler's batch fails as a whole, once, and its messages are
// then applied one by one the same way.
func TestFailingMessagesDoNotHoldTheBatchBack(t *testing.T) {
	t.Run("Handler", func(t *testing.T) { testFailingMessages(t, false) })
	t.Run("BatchHandler", func(t *testing.T) { testFailingMessages(t, true) })
}

func testFailingMessages(t *testing.T, batched bool) {
	e := newEnv(t)
	ids := e.publish("a", "broken", "b", "flaky", "c")
	fail := map[string]error{
		"broken": consumer.Invalid("no such thing"),
		"flaky":  errors.New("store busy"),
	}
	h, bh := record(fail), newBatchRecord(fail)
	if batched {
		h = bh
	}
	c := e.consumer(h, func(cfg *consumer.Config) { cfg.ClaimMinIdle = time.Millisecond })
	if _, err := consumertest.ReadNew(e.ctx, c); err == nil {
		t.Fatal("ReadNew: no error for the flaky message")
	}
	got := e.effects()
	if got[ids[0]] != 1 || got[ids[2]] != 1 || got[ids[4]] != 1 || got[ids[1]] != 0 || got[ids[3]] != 0 {
		t.Fatalf("effects %v: want a, b and c applied once, broken and flaky not", got)
	}
	if want := []int{5}; batched && !slices.Equal(*bh.sizes, want) {
		t.Fatalf("HandleBatchTx calls of %v messages, want one of 5, then one by one through HandleTx", *bh.sizes)
	}
	if n := e.pending(); n != 2 {
		t.Fatalf("%d pending, want the 2 failed ones", n)
	}
	// The flaky one recovers; the broken one reaches its last delivery.
	delete(fail, "flaky")
	time.Sleep(5 * time.Millisecond)
	if _, err := consumertest.ClaimIdle(e.ctx, c); err != nil {
		t.Fatal(err)
	}
	if got := e.effects(); got[ids[3]] != 1 || got[ids[1]] != 0 {
		t.Fatalf("effects %v after the retry: want flaky applied, broken not", got)
	}
	dlq, err := e.rdb.XRange(e.ctx, e.rdb.Prefix+"things:dlq", "-", "+").Result()
	if err != nil || len(dlq) != 1 || dlq[0].Values["event_id"] != ids[1].String() {
		t.Fatalf("dead letters %v (%v), want the broken event", dlq, err)
	}
	var inboxed int
	if err := e.db.QueryRow(e.ctx, `SELECT count(*) FROM consumer_inbox WHERE event_id = $1`, ids[1]).Scan(&inboxed); err != nil || inboxed != 0 {
		t.Fatalf("the broken event has %d inbox rows (%v): a rolled-back message must leave none", inboxed, err)
	}
	if n := e.pending(); n != 0 {
		t.Fatalf("%d pending, want none", n)
	}
}

// With partition ownership, a batch whose lease epoch is older than the
// partition's in consumer_fences (a newer owner took the partition) commits
// nothing and reports consumer.ErrFenced; the current owner's commits.
func TestStaleOwnerCommitsNothing(t *testing.T) {
	e := newEnv(t)
	in, err := inbox.New(e.db, record(nil), inbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	msg := func() consumer.Message {
		return consumer.Message{ID: uuid.New(), Type: "thing.happened", AggregateID: "a"}
	}
	batch := func(fence string, m consumer.Message) consumer.Batch {
		return consumer.Batch{Group: "things", Partition: 3, Fence: fence, Messages: []consumer.Message{m}}
	}
	if res := in.Handle(e.ctx, batch("1733000000002|new|t2", msg())); res[0].Err != nil {
		t.Fatalf("the new owner: %v", res[0].Err)
	}
	stale := msg()
	res := in.Handle(e.ctx, batch("1733000000001|old|t1", stale))
	if !errors.Is(res[0].Err, consumer.ErrFenced) {
		t.Fatalf("the old owner: %+v, want ErrFenced", res[0])
	}
	if got := e.effects(); got[stale.ID] != 0 || len(got) != 1 {
		t.Fatalf("effects %v: the old owner's must not commit", got)
	}
	// Another partition is another fence.
	other := batch("1733000000001|old|t1", msg())
	other.Partition = 4
	if res := in.Handle(e.ctx, other); res[0].Err != nil {
		t.Fatalf("partition 4: %v", res[0].Err)
	}
	if res := in.Handle(e.ctx, batch("garbage", msg())); res[0].Err == nil {
		t.Fatal("a lease value without an epoch was accepted")
	}
}

// The cleanup deletes the ids past the retention, in batches, and only
// those of its group.
func TestCleanupKeepsTheRetention(t *testing.T) {
	e := newEnv(t)
	in, err := inbox.New(e.db, record(nil), inbox.Config{Retention: 24 * time.Hour, CleanupBatch: 3})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		age := time.Hour
		if i < 7 {
			age = 25 * time.Hour
		}
		for _, group := range []string{"things", "others"} {
			if _, err := e.db.Exec(e.ctx, `INSERT INTO consumer_inbox (consumer_group, event_id, processed_at) VALUES ($1, $2, now() - $3::interval)`,
				group, uuid.New(), fmt.Sprintf("%d seconds", int(age.Seconds()))); err != nil {
				t.Fatal(err)
			}
		}
	}
	n, err := in.Cleanup(e.ctx, "things")
	if err != nil || n != 7 {
		t.Fatalf("cleanup deleted %d (%v), want the 7 past the retention", n, err)
	}
	var left, others int
	if err := e.db.QueryRow(e.ctx, `SELECT count(*) FILTER (WHERE consumer_group = 'things'), count(*) FILTER (WHERE consumer_group = 'others') FROM consumer_inbox`).Scan(&left, &others); err != nil {
		t.Fatal(err)
	}
	if left != 3 || others != 10 {
		t.Fatalf("left %d of the group and %d of another, want 3 and 10", left, others)
	}
}

// A retention shorter than a message can be delivered again is refused
// when the consumer is made.
func TestRetentionMustOutliveRedelivery(t *testing.T) {
	e := newEnv(t)
	in, err := inbox.New(e.db, record(nil), inbox.Config{Retention: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	_, err = consumer.New(e.rdb.Client, in, consumer.Config{Name: "things", Stream: e.stream})
	if !errors.Is(err, consumer.ErrConfig) {
		t.Fatalf("an hour of inbox against the relays' hour of redelivery: %v, want consumer.ErrConfig", err)
	}
	if _, err := consumer.New(e.rdb.Client, in, consumer.Config{Name: "things", Stream: e.stream, RelayRedelivery: 10 * time.Minute}); err != nil {
		t.Fatalf("with relays that redeliver within 10 minutes: %v", err)
	}
}

// batchRecord is record as an inbox.BatchHandler: a batch's new messages in
// one INSERT, failing as a whole when one of them would fail. It keeps the
// sizes of the batches it was given.
type batchRecord struct {
	inbox.Handler
	fail  map[string]error
	sizes *[]int
}

func (b batchRecord) HandleBatchTx(ctx context.Context, tx pgx.Tx, msgs []consumer.Message) error {
	*b.sizes = append(*b.sizes, len(msgs))
	ids, aggs := make([]uuid.UUID, len(msgs)), make([]string, len(msgs))
	for i, m := range msgs {
		if err := b.fail[m.AggregateID]; err != nil {
			return err
		}
		ids[i], aggs[i] = m.ID, m.AggregateID
	}
	_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, aggregate_id) SELECT * FROM unnest($1::uuid[], $2::text[])`, ids, aggs)
	return err
}

func newBatchRecord(fail map[string]error) batchRecord {
	return batchRecord{Handler: record(fail), fail: fail, sizes: new([]int)}
}

// A BatchHandler gets a batch's new messages in one call: the inbox's
// duplicates (a redelivery, or the same event twice in the batch) left out.
func TestBatchHandlerGetsTheNewMessagesInOneCall(t *testing.T) {
	e := newEnv(t)
	ids := e.publish("a", "b")
	c := e.consumer(record(nil), nil)
	if _, err := consumertest.ReadNew(e.ctx, c); err != nil {
		t.Fatal(err)
	}
	e.xadd(ids[0], "a") // applied before
	more := e.publish("c", "d")
	e.xadd(more[0], "c") // twice in the batch
	h := newBatchRecord(nil)
	c = e.consumer(h, nil)
	if _, err := consumertest.ReadNew(e.ctx, c); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(*h.sizes, []int{2}) {
		t.Fatalf("HandleBatchTx calls of %v messages, want one of 2 (c and d)", *h.sizes)
	}
	got := e.effects()
	for _, id := range append(ids, more...) {
		if got[id] != 1 {
			t.Fatalf("effects %v: want each event once", got)
		}
	}
	if n := e.pending(); n != 0 {
		t.Fatalf("%d pending, want none", n)
	}
}
