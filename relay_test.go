package outbox_test

// End-to-end tests of the outbox on a real PostgreSQL and a real Redis:
// settle -> outbox row -> NOTIFY -> relay -> Redis stream -> anti-fraud.
// Crash points are reached by running the real outbox binary with a fail
// point armed (OUTBOX_FAILPOINT), which SIGKILLs it at exactly that point.
//
// The relay's own specifications (wake-ups, claims, order, failures,
// partition leases) are in relay/*_test.go, anti-fraud's in fraud/*_test.go;
// the tests here need the whole path: a relay and anti-fraud together
// (effects applied once through reaping, fencing, crashes, trimming), or the
// outbox binary.

import (
	"encoding/json"
	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/internal/consumertest"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/relaytest"
	"github.com/tedbank/outbox/relay/redisbroker"
	"github.com/tedbank/outbox/transfer"
)

// fixture is one test's database, Redis key prefix and helpers
// (internal/relaytest), with anti-fraud's on top.
type fixture struct {
	*relaytest.Fixture
	// partitions is how many partitions the anti-fraud state is read from
	// (report, checkEffectsOnce); 0 means one.
	partitions int
}

func newFixture(t *testing.T) *fixture { return &fixture{Fixture: relaytest.New(t)} }

// keyPrefix is anti-fraud's key prefix, under the test's Redis prefix.
func (f *fixture) keyPrefix() string { return f.Redis.Prefix + "fraud:" }

// keys are anti-fraud's keys, in f.partitions partitions.
func (f *fixture) keys() fraud.Keys {
	return fraud.Keys{Prefix: f.keyPrefix(), Partitions: f.partitions}
}

func (f *fixture) consumer(name string, mutate func(*fraud.Config)) *fraud.Consumer {
	f.T.Helper()
	cfg := fraud.Config{Config: consumer.Config{Stream: f.Stream(), KeyPrefix: f.keyPrefix(), Consumer: name,
		Block: 100 * time.Millisecond, ClaimInterval: 100 * time.Millisecond, ClaimMinIdle: 500 * time.Millisecond}}
	if mutate != nil {
		mutate(&cfg)
	}
	c, err := fraud.New(f.Redis.Client, cfg)
	if err != nil {
		f.T.Fatal(err)
	}
	return c
}

func (f *fixture) report() fraud.Report {
	f.T.Helper()
	rep, err := fraud.ReadReport(f.Ctx, f.Redis.Client, f.keys())
	if err != nil {
		f.T.Fatal(err)
	}
	return rep
}

// settled reads every settled transfer, in commit order (the seq of its
// event: settled_at is when each transaction began, and a sender's later
// writer may begin first).
func (f *fixture) settled() []transfer.Transfer {
	f.T.Helper()
	rows, err := f.Pool.Query(f.Ctx, `SELECT t.id, t.from_account, t.to_account, t.amount_cents
		FROM transfers t JOIN outbox_messages o ON o.aggregate_id = t.id::text ORDER BY o.seq`)
	if err != nil {
		f.T.Fatal(err)
	}
	teds, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (transfer.Transfer, error) {
		var t transfer.Transfer
		return t, r.Scan(&t.ID, &t.FromAccount, &t.ToAccount, &t.AmountCents)
	})
	if err != nil {
		f.T.Fatal(err)
	}
	return teds
}

// senderTotals sums the TEDs per sender, as anti-fraud's report should.
func senderTotals(teds []transfer.Transfer) map[string]fraud.AccountTotals {
	want := map[string]fraud.AccountTotals{}
	for _, t := range teds {
		a := want[t.FromAccount]
		a.SentCents += t.AmountCents
		a.Transfers++
		want[t.FromAccount] = a
	}
	return want
}

// checkEffectsOnce asserts anti-fraud holds exactly one verdict per transfer
// and totals equal to the sums over the transfers table.
func (f *fixture) checkEffectsOnce(teds []transfer.Transfer) {
	f.T.Helper()
	rep := f.report()
	if rep.Verdicts != int64(len(teds)) {
		f.T.Errorf("verdicts = %d, want %d (one per transfer)", rep.Verdicts, len(teds))
	}
	want := senderTotals(teds)
	for acct, w := range want {
		if got := rep.Accounts[acct]; got != w {
			f.T.Errorf("account %s totals = %+v, want %+v", acct, got, w)
		}
	}
	for _, t := range teds {
		v, err := fraud.Verdict(f.Ctx, f.Redis.Client, f.keys(), t.ID.String())
		if err != nil || v == "" {
			f.T.Errorf("transfer %s has no verdict (err %v)", t.ID, err)
		}
	}
}

// --- Lease, reaper, fencing -------------------------------------------------

// A relay that dies right after claiming leaves its rows publishing; after
// the lease the reaper returns them and another relay publishes them.
func TestAbandonedClaimIsReapedAndPublished(t *testing.T) {
	f := newFixture(t)
	teds := f.Settle(30)
	f.RunUntilKilled(f.OutboxCmd("relay.after-claim", "relay", "--ownership", "rows", "--stream-prefix", f.StreamPrefix(), "--batch", "100", "--lease", "1s"))

	if n := f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'publishing' AND claim_token IS NOT NULL"); n != 30 {
		t.Fatalf("%d rows publishing after the crash, want 30", n)
	}
	if got := len(f.Entries(f.Stream())); got != 0 {
		t.Fatalf("stream holds %d entries, want 0 (the relay died before XADD)", got)
	}

	// What the claims looked like before the takeover, for the message of
	// a failure (one run in .ci/run published them with nothing reaped).
	var before string
	if err := f.Pool.QueryRow(f.Ctx, `SELECT string_agg(DISTINCT format('pid %s, %s ms old', claimed_pid,
	        (extract(epoch FROM now() - claimed_at) * 1000)::int), '; ')
	   FROM outbox_messages WHERE status = 'publishing'`).Scan(&before); err != nil {
		t.Fatal(err)
	}

	cfg := f.RowsRelayConfig("r2")
	cfg.Lease, cfg.ReapInterval = time.Second, 100*time.Millisecond
	r := f.NewRelay(cfg, nil)
	sig := relaytest.Signals(r)
	f.Run(r.Run)
	outboxtest.Eventually(t, 15*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published' AND claimed_by = 'r2'") == 30
	}, "abandoned rows were not reaped and published (claims before the takeover: %s)", before)
	// The reaper signals the rows it returned once its statement committed;
	// by then the claimer may have published them (one .ci/run read the
	// count as 0 right after the rows were published): wait for its passes.
	for reaped := 0; reaped < 30; {
		n, err := sig.Reaped.WaitFor(5*time.Second, func(n int) bool { return n > 0 })
		if err == nil {
			reaped += n
			continue
		}
		var attempts string
		if err := f.Pool.QueryRow(f.Ctx, `SELECT string_agg(format('%s rows with %s attempts', n, attempts), '; ')
		   FROM (SELECT attempts, count(*) AS n FROM outbox_messages GROUP BY attempts) a`).Scan(&attempts); err != nil {
			t.Fatal(err)
		}
		st := r.Stats()
		t.Fatalf("reaped %d, want 30 (%v; stats %+v; claims before the takeover: %s; now: %s)", reaped, err, st, before, attempts)
	}
	if got := r.Stats().Reaped; got != 30 {
		t.Fatalf("the relay's stats count %d reaped, want 30", got)
	}
	if got := len(f.Entries(f.Stream())); got != 30 {
		t.Fatalf("stream holds %d entries, want 30", got)
	}
	if n := f.Count("SELECT count(*) FROM outbox_messages WHERE attempts = 1 AND last_error IS NULL"); n != 30 {
		t.Fatalf("%d rows count the expired lease as one attempt with the error cleared after publishing, want 30", n)
	}
	c := f.consumer("c1", nil)
	f.Run(c.Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return f.report().Verdicts == 30 }, "not all events judged")
	f.checkEffectsOnce(teds)
}

// A relay whose lease expired must not overwrite the newer claim: while
// another relay holds the row, the stale relay's late mark changes nothing;
// the duplicate it published is skipped downstream.
func TestStaleRelayIsFenced(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	teds := f.Settle(10)

	stallA := relaytest.NewStallingRedis(f.Redis.Client)
	a := f.NewRelay(f.RowsRelayConfig("relay-a"), stallA)
	resA := f.DrainInBackground(a)
	<-stallA.Published // A published and is now stuck before marking

	// A's lease runs out (aged on the database clock, no sleeping).
	if _, err := f.Pool.Exec(f.Ctx, "UPDATE outbox_messages SET claimed_at = claimed_at - interval '10 minutes' WHERE status = 'publishing'"); err != nil {
		t.Fatal(err)
	}
	stallB := relaytest.NewStallingRedis(f.Redis.Client)
	b := f.NewRelay(f.RowsRelayConfig("relay-b"), stallB)
	if n, err := relaytest.Reap(f.Ctx, b); err != nil || n != 10 {
		t.Fatalf("reaped %d (err %v), want 10", n, err)
	}
	resB := f.DrainInBackground(b)
	<-stallB.Published // B re-claimed and published; it has not marked yet

	close(stallA.Release)
	if res := <-resA; res.Published != 0 || res.Fenced != 10 {
		t.Fatalf("stale relay A: %+v, want 0 published and 10 fenced", res)
	}
	if n := f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'publishing' AND claimed_by = 'relay-b'"); n != 10 {
		t.Fatalf("%d rows still claimed by relay B after A's late mark, want 10", n)
	}

	close(stallB.Release)
	if res := <-resB; res.Published != 10 || res.Fenced != 0 {
		t.Fatalf("relay B: %+v, want 10 published", res)
	}
	if got := len(f.Entries(f.Stream())); got != 20 {
		t.Fatalf("stream holds %d entries, want 20 (each event twice)", got)
	}
	c := f.consumer("c1", nil)
	f.Run(c.Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return f.report().DuplicatesSkipped == 10 }, "duplicates not skipped")
	f.checkEffectsOnce(teds)
}

// --- Anti-fraud ---------------------------------------------------------------

// A crash between XADD and the mark republishes the events; anti-fraud
// applies each once.
func TestCrashAfterPublishBeforeMarkAppliesEffectOnce(t *testing.T) {
	f := newFixture(t)
	teds := f.Settle(8)
	f.RunUntilKilled(f.OutboxCmd("relay.after-xadd", "relay", "--ownership", "rows", "--stream-prefix", f.StreamPrefix(), "--lease", "1s"))
	if got := len(f.Entries(f.Stream())); got != 8 {
		t.Fatalf("stream holds %d entries after the crash, want 8", got)
	}
	if n := f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'publishing'"); n != 8 {
		t.Fatalf("%d rows publishing after the crash, want 8 (never marked)", n)
	}

	cfg := f.RowsRelayConfig("r2")
	cfg.Lease, cfg.ReapInterval = time.Second, 100*time.Millisecond
	f.Run(f.NewRelay(cfg, nil).Run)
	outboxtest.Eventually(t, 15*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 8
	}, "rows not republished after the lease")
	if got := len(f.Entries(f.Stream())); got != 16 {
		t.Fatalf("stream holds %d entries, want 16 (each event twice)", got)
	}

	f.Run(f.consumer("c1", nil).Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		rep := f.report()
		return rep.Verdicts+rep.DuplicatesSkipped == 16
	}, "not every delivery was handled")
	if rep := f.report(); rep.DuplicatesSkipped != 8 {
		t.Fatalf("duplicates skipped %d, want 8", rep.DuplicatesSkipped)
	}
	f.checkEffectsOnce(teds)
}

// A consumer that dies after applying the effect and before XACK gets the
// entries back on restart (its pending list, read from id 0) and skips them.
func TestCrashAfterEffectBeforeAckAppliesEffectOnce(t *testing.T) {
	f := newFixture(t)
	teds := f.Settle(6)
	if res, err := relaytest.DrainBatch(f.Ctx, f.NewRelay(f.RelayConfig("r1"), nil)); err != nil || res.Published != 6 {
		t.Fatalf("publish: %+v %v", res, err)
	}
	f.RunUntilKilled(f.OutboxCmd("fraud.after-effect", "fraud", "--stream", f.Stream(), "--key-prefix", f.keyPrefix(), "--consumer", "c1"))
	if rep := f.report(); rep.Verdicts != 6 {
		t.Fatalf("verdicts %d after the crash, want 6 (effect applied, not acked)", rep.Verdicts)
	}
	pending, err := f.Redis.XPending(f.Ctx, f.Stream(), fraud.DefaultGroup).Result()
	if err != nil || pending.Count != 6 {
		t.Fatalf("pending %+v (err %v), want 6 unacknowledged entries", pending, err)
	}

	// Restarted under the same name, with claiming of idle entries off: only
	// re-reading its own pending entries can bring them back.
	f.Run(f.consumer("c1", func(c *fraud.Config) { c.ClaimInterval = time.Hour }).Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return f.report().DuplicatesSkipped == 6 },
		"pending entries were not re-read after the restart")
	// The XACK follows the script that counted the duplicate.
	outboxtest.Eventually(t, 5*time.Second, func() bool {
		pending, err := f.Redis.XPending(f.Ctx, f.Stream(), fraud.DefaultGroup).Result()
		return err == nil && pending.Count == 0
	}, "entries still pending after they were skipped")
	f.checkEffectsOnce(teds)
}

// stopWithSIGTERM sends cmd SIGTERM and requires it to exit 0 within 10s.
func stopWithSIGTERM(t *testing.T, name string, cmd *exec.Cmd) {
	t.Helper()
	start := time.Now()
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("%s exited with %v after SIGTERM", name, err)
		}
		t.Logf("%s stopped %.0f ms after SIGTERM", name, float64(time.Since(start).Milliseconds()))
	case <-time.After(10 * time.Second):
		t.Fatalf("%s ignored SIGTERM for 10s", name)
	}
}

// --- End to end through the real binary ---------------------------------------

// Every settled TED reaches anti-fraud through the real commands, and the
// report contract holds; SIGTERM stops relay and consumer with exit code 0.
func TestEndToEndWithCommands(t *testing.T) {
	f := newFixture(t)
	relayMetrics, fraudMetrics := relaytest.FreeAddr(t), relaytest.FreeAddr(t)
	relayCmd := f.OutboxCmd("", "relay", "--stream-prefix", f.StreamPrefix(), "--poll", "1m", "--metrics-addr", relayMetrics)
	fraudCmd := f.OutboxCmd("", "fraud", "--stream", f.Stream(), "--key-prefix", f.keyPrefix(), "--consumer", "c1",
		"--metrics-addr", fraudMetrics)
	var relayOut, fraudOut relaytest.SyncBuffer
	relayCmd.Stdout, relayCmd.Stderr = &relayOut, &relayOut
	fraudCmd.Stdout, fraudCmd.Stderr = &fraudOut, &fraudOut
	for _, c := range []*exec.Cmd{relayCmd, fraudCmd} {
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Process.Kill() })
	}

	out, err := f.OutboxCmd("", "settle", "--count", "300", "--concurrency", "8", "--accounts", "12", "--json").CombinedOutput()
	if err != nil {
		t.Fatalf("settle: %v\n%s", err, out)
	}
	var sum struct{ Settled, Failed int }
	if err := json.Unmarshal(out, &sum); err != nil || sum.Settled != 300 || sum.Failed != 0 {
		t.Fatalf("settle summary %s (err %v)", out, err)
	}
	outboxtest.Eventually(t, 20*time.Second, func() bool { return f.report().Verdicts == 300 }, "not every TED judged")

	f.checkEffectsOnce(f.settled())
	if code, body := get(t, "http://"+relayMetrics+"/readyz"); code != 200 {
		t.Fatalf("relay /readyz: %d %s", code, body)
	}
	if got := scrape(t, "http://"+relayMetrics, "outbox_relay_published_total"); got != 300 {
		t.Fatalf("relay published_total %v, want 300", got)
	}
	if got := scrape(t, "http://"+fraudMetrics, "outbox_fraud_events_processed_total", "verdict", "approve") +
		scrape(t, "http://"+fraudMetrics, "outbox_fraud_events_processed_total", "verdict", "review"); got != 300 {
		t.Fatalf("fraud processed_total %v, want 300", got)
	}

	out, err = f.OutboxCmd("", "fraud", "report", "--json", "--key-prefix", f.keyPrefix()).Output()
	if err != nil {
		t.Fatalf("fraud report: %v", err)
	}
	var rep map[string]json.RawMessage
	if err := json.Unmarshal(out, &rep); err != nil {
		t.Fatalf("fraud report output %s: %v", out, err)
	}
	for _, k := range []string{"verdicts", "reviews", "duplicates_skipped", "dead_lettered", "accounts"} {
		if _, ok := rep[k]; !ok {
			t.Fatalf("fraud report lacks %q: %s", k, out)
		}
	}
	out, err = f.OutboxCmd("", "status", "--json", "--stream", f.Stream()).Output()
	if err != nil {
		t.Fatalf("status: %v", err)
	}
	var raw map[string]any
	if err := json.Unmarshal(out, &raw); err != nil {
		t.Fatalf("status output %s: %v", out, err)
	}
	if raw["published"] != float64(300) || raw["pending"] != float64(0) || raw["stream_length"] != float64(300) || raw["group_pending"] != float64(0) {
		t.Fatalf("status %s", out)
	}

	for name, c := range map[string]*exec.Cmd{"relay": relayCmd, "fraud": fraudCmd} {
		stopWithSIGTERM(t, name, c)
	}
}

// Trimming caps the stream but never removes an entry a consumer group has
// not read, or read and not acknowledged: a lagging consumer loses nothing.
func TestTrimmingNeverLosesWhatALaggingConsumerNeeds(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	if err := f.consumer("c1", nil).EnsureGroup(f.Ctx); err != nil { // the group exists, but lags
		t.Fatal(err)
	}
	teds := f.Settle(50)
	b := f.RedisBroker(nil, redisbroker.Config{StreamMaxLen: 10})
	r := f.NewRelayOn(f.RelayConfig("r1"), b)
	if res, err := relaytest.DrainBatch(f.Ctx, r); err != nil || res.Published != 50 {
		t.Fatalf("publish: %+v %v", res, err)
	}
	if n, err := b.TrimStream(f.Ctx, f.Stream()); err != nil || n != 0 {
		t.Fatalf("trimmed %d (err %v) although the group has read nothing", n, err)
	}

	// The consumer processes (and acknowledges) 20; another reads 10 more
	// and dies before acknowledging them.
	c20 := f.consumer("c1", func(c *fraud.Config) { c.BatchSize = 20 })
	if n, err := consumertest.ReadNew(f.Ctx, c20.Consumer); err != nil || n != 20 {
		t.Fatalf("processed %d (err %v), want 20", n, err)
	}
	res, err := f.Redis.XReadGroup(f.Ctx, &redis.XReadGroupArgs{Group: fraud.DefaultGroup, Consumer: "c2",
		Streams: []string{f.Stream(), ">"}, Count: 10, Block: -1}).Result()
	if err != nil || len(res[0].Messages) != 10 {
		t.Fatalf("read: %v", err)
	}
	unacked := res[0].Messages
	n, err := b.TrimStream(f.Ctx, f.Stream())
	if err != nil || n != 20 {
		t.Fatalf("trimmed %d (err %v), want the 20 read and acknowledged entries", n, err)
	}
	if first, _ := f.Redis.XRangeN(f.Ctx, f.Stream(), "-", "+", 1).Result(); first[0].ID != unacked[0].ID {
		t.Fatalf("oldest entry is %s, want the oldest unacknowledged %s", first[0].ID, unacked[0].ID)
	}

	// The consumers catch up (c2's entries are claimed): every TED is
	// judged, none was lost.
	f.Run(f.consumer("c1", func(c *fraud.Config) { c.ClaimMinIdle = 50 * time.Millisecond }).Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return f.report().Verdicts == 50 }, "a lagging consumer lost events to trimming")
	f.checkEffectsOnce(teds)
	// Once everything is acknowledged, the cap applies.
	if _, err := b.TrimStream(f.Ctx, f.Stream()); err != nil {
		t.Fatal(err)
	}
	if n := f.Redis.XLen(f.Ctx, f.Stream()).Val(); n != 10 {
		t.Fatalf("stream length %d after catching up, want the cap of 10", n)
	}
}

// A running relay trims the streams it publishes to on its own.
func TestRelayTrimsWhileRunning(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.Run(f.consumer("c1", nil).Run) // keeps up, so everything is acknowledged
	b := f.RedisBroker(nil, redisbroker.Config{StreamMaxLen: 10, TrimInterval: 50 * time.Millisecond})
	f.Run(f.NewRelayOn(f.RelayConfig("r1"), b).Run)
	f.Settle(40)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return f.report().Verdicts == 40 }, "events not processed")
	outboxtest.Eventually(t, 10*time.Second, func() bool { return f.Redis.XLen(f.Ctx, f.Stream()).Val() == 10 },
		"the running relay never trimmed the stream to 10 entries")
}

// Retention-based trimming respects lagging groups too.
func TestRetentionTrimmingKeepsUnacknowledged(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	if err := f.consumer("c1", nil).EnsureGroup(f.Ctx); err != nil {
		t.Fatal(err)
	}
	f.Settle(20)
	b := f.RedisBroker(nil, redisbroker.Config{StreamRetention: time.Millisecond}) // everything is "old"
	r := f.NewRelayOn(f.RelayConfig("r1"), b)
	if _, err := relaytest.DrainBatch(f.Ctx, r); err != nil {
		t.Fatal(err)
	}
	if n, err := consumertest.ReadNew(f.Ctx, f.consumer("c1", func(c *fraud.Config) { c.BatchSize = 5 }).Consumer); err != nil || n != 5 {
		t.Fatalf("processed %d (err %v)", n, err)
	}
	time.Sleep(5 * time.Millisecond)
	if n, err := b.TrimStream(f.Ctx, f.Stream()); err != nil || n != 5 {
		t.Fatalf("trimmed %d (err %v), want only the 5 acknowledged entries", n, err)
	}
}
