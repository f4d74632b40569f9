package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tedbank/outbox"
	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/relaytest"
	"github.com/tedbank/outbox/partition"
)

// Every outbox row has a partition key: the one given, or the aggregate id
// (stored as NULL, read with coalesce), also for a plain INSERT of the four
// required columns. One longer than 200 bytes is refused by Write and by the
// database.
func TestPartitionKeyDefaultsToTheAggregateID(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	msgs := []outbox.Message{
		{AggregateType: "account", AggregateID: "a-1", EventType: "account.credited", Payload: []byte(`{}`), PartitionKey: "customer-9"},
		{AggregateType: "account", AggregateID: "a-2", EventType: "account.credited", Payload: []byte(`{}`)},
	}
	var written []outbox.Written
	if err := pgx.BeginFunc(f.Ctx, f.Pool, func(tx pgx.Tx) (err error) {
		written, err = outbox.Write(f.Ctx, tx, msgs...)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	f.Exec(`INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload) VALUES ('account', 'a-3', 'account.opened', '{}')`)

	partition := func(where string, args ...any) string {
		t.Helper()
		var p string
		if err := f.Pool.QueryRow(f.Ctx, "SELECT coalesce(partition_key, aggregate_id) FROM outbox_messages WHERE "+where, args...).Scan(&p); err != nil {
			t.Fatal(err)
		}
		return p
	}
	if got := partition("id = $1", written[0].ID); got != "customer-9" {
		t.Errorf("given partition key: %q", got)
	}
	if got := partition("id = $1", written[1].ID); got != "a-2" {
		t.Errorf("default partition key: %q, want the aggregate id", got)
	}
	if got := partition("aggregate_id = 'a-3'"); got != "a-3" {
		t.Errorf("plain INSERT: partition key %q, want the aggregate id", got)
	}

	long := outbox.Message{AggregateType: "account", AggregateID: "a-4", EventType: "x", Payload: []byte(`{}`), PartitionKey: strings.Repeat("k", 201)}
	if err := long.Validate(); !errors.Is(err, outbox.ErrInvalidMessage) {
		t.Errorf("Validate of a 201-byte partition key: %v", err)
	}
	_, err := f.Pool.Exec(f.Ctx, `INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, partition_key)
		VALUES ('account', 'a-4', 'x', '{}', $1)`, strings.Repeat("k", 201))
	if err == nil || !strings.Contains(err.Error(), "outbox_messages_partition_key_set") {
		t.Errorf("INSERT of a 201-byte partition key: %v, want the CHECK to refuse it", err)
	}
}

// partition.Of is a contract other languages implement: PostgreSQL's
// spelling of it in the package doc gives the same partition for every key.
func TestPartitionOfMatchesItsSQLSpelling(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	keys := make([]string, 500)
	for i := range keys {
		keys[i] = fmt.Sprintf("acct-%d", i*7919)
	}
	keys = append(keys, "", "conta-çã", strings.Repeat("x", 200))
	for _, n := range []int{2, 16, 1000} {
		rows, err := f.Pool.Query(f.Ctx, `SELECT (('x' || substr(md5(k), 1, 8))::bit(32)::bigint) % $2 FROM unnest($1::text[]) WITH ORDINALITY AS u(k, i) ORDER BY i`, keys, n)
		if err != nil {
			t.Fatal(err)
		}
		got, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			t.Fatal(err)
		}
		for i, k := range keys {
			if want := partition.Of(k, n); got[i] != int64(want) {
				t.Fatalf("key %q of %d partitions: SQL says %d, partition.Of %d", k, n, got[i], want)
			}
		}
	}
}

// Events of one partition key reach their partition's stream in the order
// they were written, with four relays, four partitions, random publish
// failures and backoff in between, although each event is its own aggregate
// (the claim's gate orders by partition key).
func TestPerPartitionKeyOrderAcrossPartitionStreams(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	const keys, perKey, parts = 12, 20, 4
	for i := range perKey {
		err := pgx.BeginFunc(f.Ctx, f.Pool, func(tx pgx.Tx) error {
			msgs := make([]outbox.Message, keys)
			for k := range msgs {
				msgs[k] = outbox.Message{
					AggregateType: "payment", AggregateID: fmt.Sprintf("pay-%02d-%02d", k, i),
					PartitionKey: fmt.Sprintf("acct-%02d", k),
					EventType:    "payment.made", Payload: []byte(fmt.Sprintf(`{"n":%d}`, i)),
				}
			}
			_, err := outbox.Write(f.Ctx, tx, msgs...)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}

	f.PublishThroughFlakyRelays(parts, keys*perKey)

	next, seen := map[string]int{}, 0
	for p, stream := range partition.Streams(f.StreamPrefix()+"payment", parts) {
		msgs, err := f.Redis.XRange(f.Ctx, stream, "-", "+").Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range msgs {
			var body struct{ N int }
			if err := json.Unmarshal([]byte(m.Values["payload"].(string)), &body); err != nil {
				t.Fatal(err)
			}
			key := "acct-" + strings.Split(m.Values["aggregate_id"].(string), "-")[1]
			if want := partition.Of(key, parts); p != want {
				t.Fatalf("an event of %s is in partition %d, want %d", key, p, want)
			}
			if body.N != next[key] {
				t.Fatalf("partition key %s: got event %d, want %d (out of order)", key, body.N, next[key])
			}
			next[key]++
			seen++
		}
	}
	if seen != keys*perKey {
		t.Fatalf("the partition streams hold %d entries, want %d", seen, keys*perKey)
	}
}

// A second transaction writing a partition key waits at Write until the
// first one ends, so seq order is commit order per key: otherwise the later
// insert could commit first and be published before the earlier one.
func TestWritersOfOnePartitionKeyCommitInSeqOrder(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	msg := func(agg string) outbox.Message {
		return outbox.Message{AggregateType: "payment", AggregateID: agg, PartitionKey: "acct-lock", EventType: "payment.made", Payload: []byte(`{}`)}
	}
	first, err := f.Pool.Begin(f.Ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Rollback(f.Ctx)
	if _, err := outbox.Write(f.Ctx, first, msg("pay-1")); err != nil {
		t.Fatal(err)
	}
	var firstPID int
	if err := first.QueryRow(f.Ctx, "SELECT pg_backend_pid()").Scan(&firstPID); err != nil {
		t.Fatal(err)
	}

	done := make(chan error, 1)
	go func() {
		done <- pgx.BeginFunc(f.Ctx, f.Pool, func(tx pgx.Tx) error {
			_, err := outbox.Write(f.Ctx, tx, msg("pay-2"))
			return err
		})
	}()
	// The second writer must end up waiting for the first one's lock.
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		select {
		case err := <-done:
			t.Fatalf("the second writer of the key finished (%v) while the first was still open", err)
		default:
		}
		return f.Count(`SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))`, firstPID) == 1
	}, "the second writer never waited for the first")
	if err := first.Commit(f.Ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n := f.Count(`SELECT count(*) FROM outbox_messages a JOIN outbox_messages b ON a.seq < b.seq
		WHERE a.aggregate_id = 'pay-1' AND b.aggregate_id = 'pay-2'`); n != 1 {
		t.Fatal("the first writer's event does not come first in seq order")
	}

	// Writers of other keys do not wait for each other (unless their keys
	// share a lock slot): pick a key in another slot.
	other := ""
	for i := 0; other == ""; i++ {
		k := fmt.Sprintf("acct-%d", i)
		if partition.Of("payment/"+k, outbox.LockSlots) != partition.Of("payment/acct-lock", outbox.LockSlots) {
			other = k
		}
	}
	hold, err := f.Pool.Begin(f.Ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer hold.Rollback(f.Ctx)
	if _, err := outbox.Write(f.Ctx, hold, msg("pay-3")); err != nil {
		t.Fatal(err)
	}
	m := msg("pay-4")
	m.PartitionKey = other
	ctx, cancel := context.WithTimeout(f.Ctx, 5*time.Second)
	defer cancel()
	if err := pgx.BeginFunc(ctx, f.Pool, func(tx pgx.Tx) error {
		_, err := outbox.Write(ctx, tx, m)
		return err
	}); err != nil {
		t.Fatalf("a writer of another key's slot: %v", err)
	}
}

// statusJSON is what the end-to-end tests read of outbox status --json:
// its documented field names (docs/operations.md), not the command's Go
// type, so that this package's tests (which a service's go mod tidy loads)
// do not link the command and its exporters.
type statusJSON struct {
	Published    int64    `json:"published"`
	StreamLength int64    `json:"stream_length"`
	GroupPending int64    `json:"group_pending"`
	GroupLag     int64    `json:"group_lag"`
	Partitions   int      `json:"partitions"`
	Streams      []string `json:"streams"`
	ByPartition  []struct {
		Stream string `json:"stream"`
		Owner  string `json:"owner"`
	} `json:"by_partition"`
}

// A partitioned deployment through the commands, the way an operator runs
// it: OUTBOX_PARTITIONS=4 for a relay, two anti-fraud consumers and the
// admin commands. The consumers divide the partitions two and two, every TED
// is judged once, each sender's TEDs are published in commit order, and
// status and fraud report sum the partitions.
func TestPartitionedDeploymentWithCommands(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.partitions = 4
	cmd := func(args ...string) *exec.Cmd {
		c := f.OutboxCmd("", args...)
		c.Env = append(c.Env, "OUTBOX_PARTITIONS=4")
		return c
	}
	var logs relaytest.SyncBuffer
	for _, c := range []*exec.Cmd{
		cmd("relay", "--stream-prefix", f.StreamPrefix(), "--poll", "1m"),
		cmd("fraud", "--stream", f.Stream(), "--key-prefix", f.keyPrefix(), "--consumer", "c1", "--block", "200ms", "--partition-lease", "2s"),
		cmd("fraud", "--stream", f.Stream(), "--key-prefix", f.keyPrefix(), "--consumer", "c2", "--block", "200ms", "--partition-lease", "2s"),
	} {
		c.Stdout, c.Stderr = &logs, &logs
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Process.Signal(syscall.SIGTERM); _ = c.Wait() })
	}
	status := func() (st statusJSON) {
		t.Helper()
		out, err := cmd("status", "--json", "--stream", f.Stream(), "--key-prefix", f.keyPrefix()).Output()
		if err != nil {
			t.Fatalf("status: %v", err)
		}
		if err := json.Unmarshal(out, &st); err != nil {
			t.Fatalf("status output %s: %v", out, err)
		}
		return st
	}
	outboxtest.Eventually(t, 20*time.Second, func() bool {
		owners := map[string]int{}
		for _, p := range status().ByPartition {
			owners[p.Owner]++
		}
		return owners["c1"] == 2 && owners["c2"] == 2
	}, "the two consumers never held two partitions each\n%s", &logs)

	out, err := cmd("settle", "--count", "300", "--concurrency", "8", "--accounts", "12", "--json").CombinedOutput()
	if err != nil {
		t.Fatalf("settle: %v\n%s", err, out)
	}
	outboxtest.Eventually(t, 30*time.Second, func() bool { return f.report().Verdicts == 300 }, "not every TED judged\n%s", &logs)
	teds := f.settled() // in commit order
	f.checkEffectsOnce(teds)

	// Each sender's TEDs sit in its partition's stream in settled order.
	pos := map[string]int{}
	for _, stream := range partition.Streams(f.Stream(), 4) {
		for i, id := range f.Entries(stream) {
			pos[id] = i
		}
	}
	last := map[string]int{}
	seq := map[string]int{}
	for _, ted := range teds {
		var id string
		if err := f.Pool.QueryRow(f.Ctx, "SELECT id::text FROM outbox_messages WHERE aggregate_id = $1", ted.ID.String()).Scan(&id); err != nil {
			t.Fatal(err)
		}
		p, ok := pos[id]
		if !ok {
			t.Fatalf("event %s of %s is in no partition stream", id, ted.FromAccount)
		}
		if seq[ted.FromAccount] > 0 && p <= last[ted.FromAccount] {
			t.Fatalf("sender %s: a TED committed later sits earlier in the stream", ted.FromAccount)
		}
		last[ted.FromAccount], seq[ted.FromAccount] = p, seq[ted.FromAccount]+1
	}

	st := status()
	if st.Published != 300 || st.StreamLength != 300 || st.GroupPending != 0 || st.GroupLag != 0 || st.Partitions != 4 || len(st.ByPartition) != 4 {
		t.Fatalf("status: %+v", st)
	}
	// status names the streams the relay wrote, as docs/streams.md does.
	written, err := f.Redis.Keys(f.Ctx, f.Stream()+":*").Result()
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(written)
	listed := slices.Sorted(slices.Values(st.Streams))
	var documented []string
	for _, tag := range []string{"p0.1", "p1.3", "p2.1", "p3.3"} {
		documented = append(documented, f.Stream()+":{"+tag+"}")
	}
	if !slices.Equal(written, listed) || !slices.Equal(listed, documented) {
		t.Fatalf("streams written %v, listed by status %v, documented %v: all three must agree", written, listed, documented)
	}
	for p, ps := range st.ByPartition {
		if ps.Stream != st.Streams[p] {
			t.Fatalf("status: partition %d's stream %s, but streams[%d] is %s", p, ps.Stream, p, st.Streams[p])
		}
	}
	out, err = cmd("fraud", "report", "--json", "--key-prefix", f.keyPrefix()).Output()
	if err != nil {
		t.Fatalf("fraud report: %v", err)
	}
	var rep fraud.Report
	if err := json.Unmarshal(out, &rep); err != nil || rep.Verdicts != 300 || len(rep.Accounts) != 12 {
		t.Fatalf("fraud report over the partitions: %s (err %v)", out, err)
	}
}
