package inbox_test

import (
	"context"
	"fmt"
	"github.com/tedbank/outbox/consumer/natssource"
	"github.com/tedbank/outbox/internal/consumertest"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/consumer/inbox"
	"github.com/tedbank/outbox/internal/natsjs"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/relay/entry"
)

// A sender's TEDs, as in the ledger: each event updates the balance row of
// its aggregate (the receiving account) and records its effect in order
// (seq). Another transaction holding a balance row makes that event's
// update fail with lock_timeout (55P03), as in production.
type ledger struct {
	*env
}

func newLedger(t *testing.T) *ledger {
	e := newEnv(t)
	if _, err := e.db.Exec(e.ctx, `
		ALTER TABLE effects ADD COLUMN seq bigserial;
		CREATE TABLE balances (account text PRIMARY KEY, n int NOT NULL DEFAULT 0)`); err != nil {
		t.Fatal(err)
	}
	return &ledger{env: e}
}

// handler updates the aggregate's balance under a short lock_timeout and
// records the effect.
func (l *ledger) handler() inbox.Handler {
	return inbox.HandlerFunc(func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '150ms'`); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO balances (account, n) VALUES ($1, 1)
			ON CONFLICT (account) DO UPDATE SET n = balances.n + 1`, m.AggregateID); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, aggregate_id) VALUES ($1, $2)`, m.ID, m.AggregateID)
		return err
	})
}

// lock holds account's balance row in a transaction of its own until the
// returned function is called.
func (l *ledger) lock(account string) (release func()) {
	l.t.Helper()
	if _, err := l.db.Exec(l.ctx, `INSERT INTO balances (account) VALUES ($1) ON CONFLICT DO NOTHING`, account); err != nil {
		l.t.Fatal(err)
	}
	tx, err := l.db.Begin(l.ctx)
	if err != nil {
		l.t.Fatal(err)
	}
	if _, err := tx.Exec(l.ctx, `SELECT 1 FROM balances WHERE account = $1 FOR UPDATE`, account); err != nil {
		l.t.Fatal(err)
	}
	done := false
	release = func() {
		if !done {
			done = true
			_ = tx.Rollback(l.ctx)
		}
	}
	l.t.Cleanup(release)
	return release
}

// run runs c until the test ends.
func (l *ledger) run(c *consumer.Consumer) {
	ctx, cancel := context.WithCancel(l.ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = c.Run(ctx) }()
	l.t.Cleanup(func() { cancel(); <-done })
}

// applied lists the events applied, in the order they took effect.
func (l *ledger) applied() []uuid.UUID {
	l.t.Helper()
	rows, _ := l.db.Query(l.ctx, `SELECT event_id FROM effects ORDER BY seq`)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	if err != nil {
		l.t.Fatal(err)
	}
	return ids
}

// inOrder reports why the events of want (one key's, in settled order) did
// not take effect once each, in that order, or "".
func inOrder(applied, want []uuid.UUID) string {
	var got []uuid.UUID
	for _, id := range applied {
		if slices.Contains(want, id) {
			got = append(got, id)
		}
	}
	if !slices.Equal(got, want) {
		return fmt.Sprintf("took effect as %v, want %v", got, want)
	}
	return ""
}

// A read returns a sender's TED #1 (to account X) and
// TED #2 (to Y); X's row is locked, so #1 fails with a lock timeout and the
// batch falls back to a transaction per message. #2 must not take effect
// before #1: it is held, and so is #4, read later while #1 is still
// pending; another sender's TED (#3) is not held back. Once X is free, the
// retry applies #1, #2 and #4 in that order.
func TestFailedMessageHoldsItsKeyBack(t *testing.T) {
	l := newLedger(t)
	release := l.lock("X")
	ted := []uuid.UUID{uuid.New(), uuid.New(), uuid.New(), uuid.New()}
	l.xaddKey(ted[0], "X", "sender-1")
	l.xaddKey(ted[1], "Y", "sender-1")
	l.xaddKey(ted[2], "Z", "sender-2")
	c := l.consumer(l.handler(), nil)
	if _, err := consumertest.ReadNew(l.ctx, c); err == nil {
		t.Fatal("ReadNew: no error for the TED whose row is locked")
	}
	if got := l.applied(); !slices.Equal(got, ted[2:3]) {
		t.Fatalf("applied %v while #1 waits for X: want only the other sender's #3 %v (#2 %v must wait for #1)", got, ted[2], ted[1])
	}
	l.xaddKey(ted[3], "W", "sender-1")
	if _, err := consumertest.ReadNew(l.ctx, c); err != nil {
		t.Fatalf("ReadNew of #4: %v", err)
	}
	if got := l.applied(); len(got) != 1 {
		t.Fatalf("applied %v: #4 of a sender whose #1 is pending must wait", got)
	}
	if n := l.pending(); n != 3 {
		t.Fatalf("%d entries pending, want #1, #2 and #4", n)
	}
	release()
	if err := consumertest.ProcessPending(l.ctx, c); err != nil {
		t.Fatal(err)
	}
	want := []uuid.UUID{ted[0], ted[1], ted[3]}
	if why := inOrder(l.applied(), want); why != "" {
		t.Fatalf("sender-1's TEDs %s", why)
	}
	if n := l.pending(); n != 0 {
		t.Fatalf("%d entries pending, want none", n)
	}
	if st := c.Stats(); st.Processed != 4 {
		t.Fatalf("stats %+v, want 4 processed", st)
	}
}

// The case above, and a failure that keeps failing, as a running consumer meets them, on both
// brokers: X's row is locked for a while; a sender's TED #1 (to X) keeps
// failing and waits out its retry backoff while the consumer reads on: its
// #2 in the same read and #4 settled later must not take effect before it,
// nor may another sender's #3 be held back.
func TestRunningConsumerKeepsAKeysOrderAcrossRetries(t *testing.T) {
	for _, broker := range []string{"redis", "nats"} {
		t.Run(broker, func(t *testing.T) {
			l := newLedger(t)
			var publish func(id uuid.UUID, agg, key string)
			var c *consumer.Consumer
			in, err := inbox.New(l.db, l.handler(), inbox.Config{})
			if err != nil {
				t.Fatal(err)
			}
			cfg := consumer.Config{Name: "things", Stream: l.stream, KeyPrefix: l.rdb.Prefix + "things:", Consumer: "c1",
				Block: 100 * time.Millisecond, PartitionLease: time.Second}
			switch broker {
			case "redis":
				publish = l.xaddKey
				c, err = consumer.New(l.rdb.Client, in, cfg)
			case "nats":
				nc, js, cerr := natsjs.Connect(outboxtest.NATSURL(t), "outbox-test")
				if cerr != nil {
					t.Fatal(cerr)
				}
				t.Cleanup(nc.Close)
				if _, err := natsjs.Ensure(l.ctx, js, natsjs.Stream{Name: outboxtest.NATSStream(t), SubjectPrefix: l.rdb.Prefix + "outbox.event."}); err != nil {
					t.Fatal(err)
				}
				publish = func(id uuid.UUID, agg, key string) {
					t.Helper()
					_, err := js.PublishMsg(l.ctx, &nats.Msg{Subject: l.stream, Data: []byte(`{}`), Header: nats.Header{
						jetstream.MsgIDHeader: {id.String()}, entry.EventID: {id.String()}, entry.EventType: {"thing.happened"},
						entry.AggregateType: {"thing"}, entry.AggregateID: {agg}, entry.Headers: {"{}"}, entry.PartitionKey: {key},
					}})
					if err != nil {
						t.Fatal(err)
					}
				}
				c, err = consumer.NewWithSource(l.rdb.Client, natssource.New(js), in, cfg)
			}
			if err != nil {
				t.Fatal(err)
			}
			l.run(c)

			release := l.lock("X")
			ted := []uuid.UUID{uuid.New(), uuid.New(), uuid.New(), uuid.New()}
			publish(ted[0], "X", "sender-1")
			publish(ted[1], "Y", "sender-1")
			publish(ted[2], "Z", "sender-2")
			outboxtest.Eventually(t, 10*time.Second, func() bool { return slices.Contains(l.applied(), ted[2]) },
				"the other sender's #3 was held back by sender-1's locked row")
			publish(ted[3], "W", "sender-1")
			time.Sleep(time.Second) // #1 fails and retries meanwhile
			if got := l.applied(); len(got) != 1 {
				t.Fatalf("applied %v while sender-1's #1 is failing: want only #3", got)
			}
			release()
			outboxtest.Eventually(t, 15*time.Second, func() bool { return len(l.applied()) == 4 },
				"applied %v, want all 4 TEDs once X is free", l.applied())
			if why := inOrder(l.applied(), []uuid.UUID{ted[0], ted[1], ted[3]}); why != "" {
				t.Fatalf("sender-1's TEDs %s", why)
			}
		})
	}
}

// A partition's new owner whose first pending entry (left by a consumer
// that died) keeps failing does not stay in its takeover: the entry waits
// for its retry, held in the gate, while the other keys' new entries are
// applied.
func TestFailingEntryAtTakeoverDoesNotStopOtherKeys(t *testing.T) {
	l := newLedger(t)
	release := l.lock("X")
	first := uuid.New()
	l.xaddKey(first, "X", "sender-1")
	// A consumer read it and died.
	c := l.consumer(l.handler(), func(cfg *consumer.Config) { cfg.Block, cfg.PartitionLease = 100*time.Millisecond, time.Second })
	if err := l.rdb.XReadGroup(l.ctx, &redis.XReadGroupArgs{Group: "things", Consumer: "dead", Streams: []string{l.stream, ">"}, Count: 1}).Err(); err != nil {
		t.Fatal(err)
	}
	l.run(c)
	other := uuid.New()
	outboxtest.Eventually(t, 10*time.Second, func() bool { return c.Stats().Failed > 0 }, "the takeover never met the failing entry")
	l.xaddKey(other, "Z", "sender-2")
	outboxtest.Eventually(t, 5*time.Second, func() bool { return slices.Contains(l.applied(), other) },
		"another sender's entry waited for the failing one the new owner took over")
	release()
	outboxtest.Eventually(t, 15*time.Second, func() bool { return slices.Contains(l.applied(), first) }, "the failed entry was never applied")
}
