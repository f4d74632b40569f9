package outbox_test

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/partition"
	"github.com/tedbank/outbox/transfer"
)

// A service that settles TEDs with plain SQL, as the README allows, writes
// no partition_key: migration 0015 keys each transfer.settled row by its
// sender (the payload's from_account), as transfer.Settle does, so that the
// relays route it to the partition anti-fraud judges its sender in. Every
// TED is judged once, each sender's in settled order, whatever the number
// of partitions. (Before 0015 the relays routed such a row by its transfer
// id, and anti-fraud kept 3 in 4 of them pending forever, "in another
// partition".)
func TestTEDsWrittenInPlainSQLAreJudgedInEveryPartition(t *testing.T) {
	t.Parallel()
	const parts, senders, perSender = 4, 5, 4
	f := newFixture(t)
	f.partitions = parts
	var teds []transfer.Transfer
	for i := range senders * perSender {
		ted := transfer.Transfer{ID: uuid.New(), FromAccount: fmt.Sprintf("plain-%d", i%senders),
			ToAccount: "dest", AmountCents: int64(100 + i)}
		teds = append(teds, ted)
		f.Exec(`WITH t AS (
				INSERT INTO transfers (id, from_account, to_account, amount_cents)
				VALUES ($1, $2, $3, $4) RETURNING settled_at)
			INSERT INTO outbox_messages (id, aggregate_type, aggregate_id, event_type, payload)
			SELECT $5, 'transfer', $1::text, 'transfer.settled', jsonb_build_object(
				'schema_version', 1, 'event_id', $5::uuid, 'transfer_id', $1::uuid, 'from_account', $2::text,
				'to_account', $3::text, 'amount_cents', $4::bigint, 'currency', 'BRL', 'settled_at', t.settled_at)
			FROM t`, ted.ID, ted.FromAccount, ted.ToAccount, ted.AmountCents, uuid.New())
	}
	if n := f.Count(`SELECT count(*) FROM outbox_messages
		WHERE partition_key IS DISTINCT FROM payload->>'from_account'`); n != 0 {
		t.Fatalf("%d of %d rows not keyed by their sender", n, len(teds))
	}
	// A sender the key cannot hold leaves the key unset: the settlement
	// is not refused for it (anti-fraud dead-letters the payload).
	f.Exec(`INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload)
		VALUES ('transfer', 'odd', 'transfer.settled', jsonb_build_object('from_account', ''))`)
	if n := f.Count(`WITH d AS (DELETE FROM outbox_messages WHERE aggregate_id = 'odd' AND partition_key IS NULL
		RETURNING 1) SELECT count(*) FROM d`); n != 1 {
		t.Fatal("the row of an empty sender was keyed")
	}
	// The writer's own key is kept.
	f.Exec(`INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES ('order', 'o-1', 'order.placed', '{"from_account": "x"}', 'customer-1')`)
	if n := f.Count(`SELECT count(*) FROM outbox_messages WHERE partition_key = 'customer-1'`); n != 1 {
		t.Fatal("a writer's own partition key was replaced")
	}

	rcfg := f.RelayConfig("relay")
	rcfg.Partitions = parts
	f.Run(f.NewRelay(rcfg, nil).Run)
	f.Run(f.consumer("c1", func(c *fraud.Config) { c.Partitions = parts }).Run)
	var judged int64
	outboxtest.Eventually(t, 20*time.Second, func() bool {
		judged = f.report().Verdicts
		return judged == int64(len(teds))
	}, "not every plain-SQL TED was judged")
	t.Logf("%d of %d plain-SQL TEDs judged", judged, len(teds))
	f.checkEffectsOnce(teds)

	// Each sender's TEDs are in its partition's stream, in settled order.
	for s := range senders {
		sender := fmt.Sprintf("plain-%d", s)
		var want []string
		for _, ted := range teds {
			if ted.FromAccount == sender {
				want = append(want, ted.ID.String())
			}
		}
		msgs, err := f.Redis.XRange(f.Ctx, partition.Stream(f.Stream(), partition.Of(sender, parts), parts), "-", "+").Result()
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, m := range msgs {
			if m.Values["partition_key"] == sender && !slices.Contains(got, m.Values["aggregate_id"].(string)) {
				got = append(got, m.Values["aggregate_id"].(string))
			}
		}
		if !slices.Equal(got, want) {
			t.Errorf("sender %s: TEDs in its partition's stream %v, want %v", sender, got, want)
		}
	}
}

// Two transactions settling TEDs of one sender with plain SQL, the second
// inserting while the first is still open: migration 0015 makes the second
// wait for the first (the sender's lock slot, as outbox.Write takes it), so
// its event's seq is the later one and the relays publish the sender's TEDs
// in commit order. Without the lock the second could commit first with the
// later seq unseen: published before the first, out of order.
func TestPlainSQLTEDsOfOneSenderTakeSeqInCommitOrder(t *testing.T) {
	f := newFixture(t)
	insert := `INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload)
		VALUES ('transfer', $1, 'transfer.settled', '{"from_account": "ana"}') RETURNING seq`
	first, err := f.Pool.Begin(f.Ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Rollback(f.Ctx) //nolint:errcheck // after Commit, a no-op
	var seqFirst, seqSecond int64
	if err := first.QueryRow(f.Ctx, insert, "t-1").Scan(&seqFirst); err != nil {
		t.Fatal(err)
	}
	second, err := f.Pool.Acquire(f.Ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer second.Release()
	var pid int
	if err := second.QueryRow(f.Ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- second.QueryRow(f.Ctx, insert, "t-2").Scan(&seqSecond) }()
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.Count(`SELECT count(*) FROM pg_locks WHERE pid = $1 AND locktype = 'advisory' AND NOT granted`, pid) == 1
	}, "the second writer of the sender did not wait for the first")
	if err := first.Commit(f.Ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if seqSecond <= seqFirst {
		t.Fatalf("seq %d for the later commit, %d for the earlier: want the later commit's seq after", seqSecond, seqFirst)
	}
}
