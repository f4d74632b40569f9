package relay_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/relaytest"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/transfer"
)

// Four relays drain one backlog concurrently: every event is published
// exactly once, and no claim takes more than a batch.
func TestRelaysDrainDisjointRows(t *testing.T) {
	f := newFixture(t)
	const n, batch = 2000, 25
	msgs := make([]outbox.Message, n)
	for i := range msgs {
		msgs[i] = outbox.Message{AggregateType: "transfer", AggregateID: uuid.NewString(), EventType: "test.event", Payload: []byte(`{}`)}
	}
	if err := pgx.BeginFunc(f.Ctx, f.Pool, func(tx pgx.Tx) error { _, err := outbox.Write(f.Ctx, tx, msgs...); return err }); err != nil {
		t.Fatal(err)
	}

	counter := relaytest.NewCountingRedis(f.Redis.Client)
	var wg sync.WaitGroup
	var maxClaim, published, fenced int
	var mu sync.Mutex
	for i := range 4 {
		cfg := f.RowsRelayConfig(fmt.Sprintf("r%d", i))
		cfg.BatchSize = batch
		r := f.NewRelay(cfg, counter)
		wg.Go(func() {
			for {
				res, err := relaytest.DrainBatch(f.Ctx, r)
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				maxClaim, published, fenced = max(maxClaim, res.Claimed), published+res.Published, fenced+res.Fenced
				mu.Unlock()
				if res.Claimed == 0 {
					return
				}
			}
		})
	}
	wg.Wait()
	if maxClaim > batch {
		t.Fatalf("a claim took %d rows, batch is %d", maxClaim, batch)
	}
	if published != n || fenced != 0 {
		t.Fatalf("published %d fenced %d, want %d and 0", published, fenced, n)
	}
	if len(counter.Seen()) != n {
		t.Fatalf("%d distinct events published, want %d", len(counter.Seen()), n)
	}
	for id, c := range counter.Seen() {
		if c != 1 {
			t.Fatalf("event %s published %d times: claimed by two relays at once", id, c)
		}
	}
	if got := f.Count("SELECT count(DISTINCT claimed_by) FROM outbox_messages"); got < 2 {
		t.Fatalf("only %d relay did the work; the test did not exercise concurrency", got)
	}
}

// Events of one aggregate reach the stream in the order they were written,
// with four relays, random publish failures and backoff in between.
func TestPerAggregateOrderSurvivesFailuresAndRelays(t *testing.T) {
	f := newFixture(t)
	const aggregates, perAggregate = 20, 25
	f.WriteInterleaved(aggregates, perAggregate)
	f.PublishThroughFlakyRelays(1, aggregates*perAggregate)
	f.CheckInterleavedOrder(aggregates, perAggregate)
}

// An event that keeps failing backs off, ends dead after MaxAttempts with its
// error kept, and never holds up other aggregates.
func TestFailingEventGoesDeadWithoutBlockingOthers(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	// A string key where the "poison" aggregate's stream should be: every XADD
	// to it fails with WRONGTYPE, a per-event error.
	if err := f.Redis.Set(f.Ctx, f.StreamPrefix()+"poison", "not a stream", 0).Err(); err != nil {
		t.Fatal(err)
	}
	err := pgx.BeginFunc(f.Ctx, f.Pool, func(tx pgx.Tx) error {
		_, err := outbox.Write(f.Ctx, tx, outbox.Message{AggregateType: "poison", AggregateID: "p1", EventType: "x", Payload: []byte(`{}`)})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	teds := f.Settle(5)

	cfg := f.RelayConfig("r1")
	cfg.PollInterval, cfg.MaxAttempts = 5*time.Millisecond, 4
	cfg.BackoffBase, cfg.BackoffMax = 10*time.Millisecond, 40*time.Millisecond
	var logs relaytest.SyncBuffer
	cfg.Logger = slog.New(slog.NewJSONHandler(&logs, nil))
	r := f.NewRelay(cfg, nil)
	f.Run(r.Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE aggregate_type = 'poison' AND status = 'dead'") == 1
	}, "poison event never went dead")
	// The death is an ERROR that names the event and says why (logged once
	// the row's death is committed, so it may come a moment after).
	var deaths []map[string]any
	outboxtest.Eventually(t, 5*time.Second, func() bool {
		deaths = nil
		for _, line := range bytes.Split(logs.Bytes(), []byte("\n")) {
			var rec map[string]any
			if json.Unmarshal(line, &rec) == nil && rec["level"] == "ERROR" {
				deaths = append(deaths, rec)
			}
		}
		return len(deaths) > 0
	}, "the death of the poison event was never logged at ERROR")
	var poisonID string
	if err := f.Pool.QueryRow(f.Ctx, "SELECT id::text FROM outbox_messages WHERE aggregate_type = 'poison'").Scan(&poisonID); err != nil {
		t.Fatal(err)
	}
	if len(deaths) != 1 || deaths[0]["event_id"] != poisonID || deaths[0]["aggregate_type"] != "poison" ||
		deaths[0]["aggregate_id"] != "p1" || deaths[0]["event_type"] != "x" || deaths[0]["attempts"] != float64(4) ||
		deaths[0]["max_attempts"] != float64(4) || !strings.Contains(fmt.Sprint(deaths[0]["last_error"]), "WRONGTYPE") {
		t.Fatalf("want one ERROR naming the dead event %s with its attempts and last error; got %v", poisonID, deaths)
	}
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE aggregate_type = 'transfer' AND status = 'published'") == len(teds)
	}, "transfer events not all published next to a poison event")
	var attempts int
	var lastErr string
	var spread float64
	if err := f.Pool.QueryRow(f.Ctx, `SELECT attempts, last_error, extract(epoch FROM next_attempt_at - created_at)
		FROM outbox_messages WHERE aggregate_type = 'poison'`).Scan(&attempts, &lastErr, &spread); err != nil {
		t.Fatal(err)
	}
	if attempts != 4 || lastErr == "" {
		t.Fatalf("dead row: attempts %d last_error %q, want 4 and the WRONGTYPE error", attempts, lastErr)
	}
	if spread < 0.015 { // 3 backoffs of at least 5, 10 and 20 ms
		t.Fatalf("retries spread over %.3fs: no backoff between attempts", spread)
	}
}

// While Redis refuses every write the relay gives rows back without burning
// their attempts, and publishes them once Redis answers again.
func TestBrokerOutageDoesNotBurnAttempts(t *testing.T) {
	f := newFixture(t)
	down := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: 100 * time.Millisecond})
	t.Cleanup(func() { _ = down.Close() })
	cfg := f.RelayConfig("r1")
	cfg.MaxAttempts = 2
	r := f.NewRelay(cfg, down)
	f.Settle(3)
	for range 5 {
		res, err := relaytest.DrainBatch(f.Ctx, r)
		if err != nil {
			t.Fatal(err)
		}
		if res.Claimed > 0 && (!res.BrokerDown || res.Released != res.Claimed) {
			t.Fatalf("batch %+v: want every row released as broker down", res)
		}
		if _, err := f.Pool.Exec(f.Ctx, "UPDATE outbox_messages SET next_attempt_at = now()"); err != nil {
			t.Fatal(err)
		}
	}
	released := "last_error LIKE 'released:%'" // row claims give the rows back
	if r.Ownership() == relay.OwnPartitions {
		released = "claim_token IS NULL" // partition owners only read them
	}
	if n := f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'pending' AND attempts = 0 AND " + released); n != 3 {
		t.Fatalf("%d rows pending with no attempt spent, want 3", n)
	}
	// Another relay takes over (with partition leases, once the first
	// relay's leases have run out: aged on the database clock).
	f.ExpireRelayLeases()
	if n := f.DrainAll(f.NewRelay(cfg, nil)); n != 3 {
		t.Fatalf("after the outage: %d published, want 3", n)
	}
}

// A Redis of the test's own refuses writes (out of memory under noeviction)
// for 6 s while TEDs settle, then takes them again. The relay probes it with
// one row at a time, at most a second apart, and so publishes the backlog
// within about a second of Redis taking writes again; before, it retried
// whole batches at steps doubling up to 10 s and could wait up to twice the
// outage. Every row it gave back during the outage was a probe's.
func TestRelayIsBackWithinASecondOfRedisTakingWritesAgain(t *testing.T) {
	rdb := outboxtest.OwnRedis(t, "--maxmemory-policy", "noeviction").Client

	f := newFixture(t)
	r := f.NewRelay(f.RelayConfig("r1"), rdb)
	sig := relaytest.Signals(r)
	f.Run(r.Run)
	relaytest.WaitCaughtUp(t, sig, 0)
	f.Settle(1)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return r.Stats().Published == 1 }, "the first TED was not published")

	if err := rdb.ConfigSet(f.Ctx, "maxmemory", "1").Err(); err != nil {
		t.Fatal(err)
	}
	before := r.Stats()
	// TEDs of senders of their own: a claim may take them all.
	const outage = 6 * time.Second
	settled := 1
	for end := time.Now().Add(outage); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		ted := transfer.Transfer{ID: uuid.New(), FromAccount: fmt.Sprintf("sender-%03d", settled), ToAccount: "acct-07", AmountCents: 100}
		if _, err := transfer.Settle(f.Ctx, f.Pool, ted); err != nil {
			t.Fatal(err)
		}
		settled++
	}
	during := r.Stats()
	if err := rdb.ConfigSet(f.Ctx, "maxmemory", "0").Err(); err != nil {
		t.Fatal(err)
	}
	back := time.Now()
	outboxtest.Eventually(t, 15*time.Second, func() bool { return r.Stats().Published == int64(settled) },
		"%d of %d TEDs published", r.Stats().Published, settled)
	took := time.Since(back)
	claims, released := during.Claims-before.Claims, during.Released-before.Released
	t.Logf("outage %s: %d claims gave back %d rows; the %d TEDs were published %s after Redis took writes again",
		outage, claims, released, settled-1, took.Round(time.Millisecond))
	if during.Published != before.Published {
		t.Fatalf("%d published while Redis refused writes", during.Published-before.Published)
	}
	// The first refused claim may have held the few rows settled before it;
	// every claim after it is a probe of one.
	if released == 0 || released > claims+3 {
		t.Errorf("%d claims gave back %d rows during the outage: want one row a claim after the first refusal", claims, released)
	}
	// A probe's step is at most a second; the rest is slack for a loaded
	// machine under -race.
	if took > 2*time.Second {
		t.Errorf("the backlog was published %s after Redis took writes again, want within about a second", took.Round(time.Millisecond))
	}
}

// Publishing an event makes the next event of its aggregate claimable, and no
// NOTIFY announces that: the relay must keep draining, not wait for a poll.
func TestAggregateChainDrainsWithoutPolling(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	r := f.NewRelay(f.RelayConfig("r1"), nil)
	f.Run(r.Run)
	outboxtest.Eventually(t, 5*time.Second, func() bool { return r.Stats().ListenUp }, "relay never LISTENed")
	err := pgx.BeginFunc(f.Ctx, f.Pool, func(tx pgx.Tx) error {
		msgs := make([]outbox.Message, 5)
		for i := range msgs {
			msgs[i] = outbox.Message{AggregateType: "account", AggregateID: "acct-1", EventType: "account.changed", Payload: []byte(`{}`)}
		}
		_, err := outbox.Write(f.Ctx, tx, msgs...)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	outboxtest.Eventually(t, 5*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 5
	}, "a chain of one aggregate's events waits for the (10 minute) fallback poll")
	if r.Stats().Polls != 0 {
		t.Fatal("drained by the fallback poll")
	}
}

// SKIP LOCKED: a row locked by someone else (another relay's claim in
// progress) does not make a claim wait; the claim takes the other rows.
func TestClaimSkipsLockedRows(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.Settle(5)
	tx, err := f.Pool.Begin(f.Ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(f.Ctx) }()
	if _, err := tx.Exec(f.Ctx, "SELECT id FROM outbox_messages ORDER BY seq LIMIT 1 FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(f.Ctx, 5*time.Second)
	defer cancel()
	done := make(chan relay.BatchResult, 1)
	go func() {
		res, err := relaytest.DrainBatch(ctx, f.NewRelay(f.RowsRelayConfig("r1"), nil))
		if err != nil {
			t.Error(err)
		}
		done <- res
	}()
	select {
	case res := <-done:
		if res.Published != 4 {
			t.Fatalf("claim around a locked row: %+v, want the 4 other rows published", res)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("claim waited for a row lock held elsewhere: no SKIP LOCKED")
	}
}

// On shutdown the relay stops claiming but finishes the batch in flight, so
// nothing waits for a lease to expire.
func TestShutdownFinishesBatchInFlight(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.Settle(10)
	stall := relaytest.NewStallingRedis(f.Redis.Client)
	r := f.NewRelay(f.RelayConfig("r1"), stall)
	ctx, cancel := context.WithCancel(f.Ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	<-stall.Published
	cancel() // SIGTERM arrives while the batch is between XADD and the mark
	time.AfterFunc(200*time.Millisecond, func() { close(stall.Release) })
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("relay did not stop within 10s")
	}
	if n := f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'"); n != 10 {
		t.Fatalf("%d rows published, want 10: the batch in flight was abandoned", n)
	}
}
