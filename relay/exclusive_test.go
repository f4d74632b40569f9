package relay_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/tedbank/outbox"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/relaytest"
	"github.com/tedbank/outbox/relay"
)

// Relays claiming rows and relays leasing partitions never
// run side by side on one database (a claimer's 'publishing' row does not
// hold back an owner's read of the next event of its key). A relay of the
// other ownership refuses to start while one runs, whichever starts first;
// once it stopped (its LISTEN connection closed), the other ownership starts.
func TestRelaysOfBothOwnershipsNeverShareADatabase(t *testing.T) {
	for _, first := range []string{relay.OwnRows, relay.OwnPartitions} {
		t.Run("first "+first, func(t *testing.T) {
			f := newFixture(t)
			second := relay.OwnPartitions
			if first == relay.OwnPartitions {
				second = relay.OwnRows
			}
			cfg := f.RelayConfigOf
			running := f.NewRelay(cfg("r1", first), nil)
			stop := f.Run(running.Run)
			outboxtest.Eventually(t, 10*time.Second, func() bool { return running.Stats().ListenUp }, "the first relay never listened")
			same := f.NewRelay(cfg("r2", first), nil)
			stopSame := f.Run(same.Run)
			outboxtest.Eventually(t, 10*time.Second, func() bool { return same.Stats().ListenUp }, "a second relay of the same ownership never listened")
			stopSame()

			other := f.NewRelay(cfg("r3", second), nil)
			ctx, cancel := context.WithTimeout(f.Ctx, 20*time.Second)
			defer cancel()
			if err := other.Run(ctx); !errors.Is(err, relay.ErrMixedOwnership) {
				t.Fatalf("a relay of ownership %s next to one of %s: Run returned %v, want ErrMixedOwnership", second, first, err)
			}
			stop()
			after := f.NewRelay(cfg("r4", second), nil)
			f.Run(after.Run)
			outboxtest.Eventually(t, 10*time.Second, func() bool { return after.Stats().ListenUp },
				"once the %s relay stopped, a %s relay never started", first, second)
		})
	}
}

// OwnAuto, the outbox relay command's default: a relay follows the ownership of the relays running
// on its database, and leases partitions where none runs. So a rolling
// upgrade of relays that claim rows never stops at ErrMixedOwnership. With
// no relay alive it still claims rows while a row claimer may be running
// unseen: registered and not known gone (a PostgreSQL restart cut its
// LISTEN connection, its pool goes on claiming), or with a claim younger
// than the lease.
func TestAutoOwnershipFollowsTheRelaysRunning(t *testing.T) {
	const lease = 5 * time.Second
	for _, c := range []struct {
		name  string
		setup func(f *fixture)
		want  string
	}{
		{"no relay", func(*fixture) {}, relay.OwnPartitions},
		{"a row claimer running", runningRelay(relay.OwnRows), relay.OwnRows},
		{"a partition owner running", runningRelay(relay.OwnPartitions), relay.OwnPartitions},
		{"a row claimer registered whose LISTEN backend is gone", func(f *fixture) {
			f.Exec("INSERT INTO outbox_relay_members (owner, seen_until, pid) VALUES ('cut-off', 'infinity', 2147483000)")
		}, relay.OwnRows},
		{"a claim younger than the lease", func(f *fixture) {
			f.Settle(1)
			f.Exec(`UPDATE outbox_messages SET status = 'publishing', claimed_by = 'unseen', claim_token = gen_random_uuid(),
				claimed_at = now()`)
		}, relay.OwnRows},
		{"only a claim older than the lease", func(f *fixture) {
			f.Settle(1)
			f.Exec(`UPDATE outbox_messages SET status = 'publishing', claimed_by = 'gone', claim_token = gen_random_uuid(),
				claimed_at = now() - interval '1 minute'`)
		}, relay.OwnPartitions},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t)
			c.setup(f)
			cfg := f.RelayConfig("auto")
			cfg.Ownership, cfg.Lease = relay.OwnAuto, lease
			auto := f.NewRelay(cfg, nil)
			if got := auto.Ownership(); got != "" {
				t.Fatalf("ownership %q before Run, want none chosen yet", got)
			}
			ctx, cancel := context.WithCancel(f.Ctx)
			done := make(chan error, 1)
			go func() { done <- auto.Run(ctx) }()
			defer func() {
				cancel()
				if err := <-done; err != nil {
					t.Errorf("the auto relay: %v", err)
				}
			}()
			outboxtest.Eventually(t, 10*time.Second, func() bool { return auto.Stats().ListenUp }, "the auto relay never listened")
			if got := auto.Ownership(); got != c.want {
				t.Fatalf("the auto relay runs %q, want %q", got, c.want)
			}
			// It runs on: the check after its LISTEN connection found no
			// relay of the other ownership.
			select {
			case err := <-done:
				t.Fatalf("the auto relay stopped: %v", err)
			case <-time.After(500 * time.Millisecond):
			}
			if c.want == relay.OwnRows {
				if held := f.LeaseHolders()["auto"]; held != 0 {
					t.Fatalf("the auto relay claims rows and holds %d partition slots", held)
				}
				return
			}
			// A partition owner takes its share (beside a relay holding
			// every slot, once that one gave half back), and publishes what
			// a claimer long gone left publishing.
			outboxtest.Eventually(t, 15*time.Second, func() bool { return f.LeaseHolders()["auto"] > 0 },
				"the auto relay leases partitions and holds no slot")
			outboxtest.Eventually(t, 10*time.Second, func() bool {
				return f.Count("SELECT count(*) FROM outbox_messages WHERE status <> 'published'") == 0
			}, "rows left unpublished")
		})
	}
}

// runningRelay starts a relay of the ownership given and waits until it
// listens (holds its ownership lock).
func runningRelay(ownership string) func(f *fixture) {
	return func(f *fixture) {
		r := f.NewRelay(f.RelayConfigOf("running", ownership), nil)
		f.Run(r.Run)
		outboxtest.Eventually(f.T, 10*time.Second, func() bool { return r.Stats().ListenUp }, "the running relay never listened")
	}
}

// A relay left to choose its ownership waits for a database that does not
// answer yet (it returns nil when stopped before it could start), and
// chooses and starts once the database answers.
func TestAutoOwnershipWaitsForTheDatabase(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	pool, _, proxy := f.ProxiedPool("")
	proxy.Down()

	cfg := f.RelayConfigOf("auto", relay.OwnAuto)
	r := f.NewRelayWithPool(pool, cfg)
	ctx, cancel := context.WithTimeout(f.Ctx, 1500*time.Millisecond)
	defer cancel()
	if err := r.Run(ctx); err != nil {
		t.Fatalf("Run stopped while choosing its ownership: %v, want nil", err)
	}
	if got := r.Ownership(); got != "" {
		t.Fatalf("ownership %q chosen without a database", got)
	}

	// Run again, and the database comes back after a while.
	f.Run(r.Run)
	time.Sleep(time.Second)
	if got := r.Ownership(); got != "" || r.Stats().ListenUp {
		t.Fatalf("without a database: ownership %q, listening %v", got, r.Stats().ListenUp)
	}
	proxy.Up()
	outboxtest.Eventually(t, 10*time.Second, func() bool { return r.Stats().ListenUp },
		"the relay never started once the database answered")
	if got := r.Ownership(); got != relay.OwnPartitions {
		t.Fatalf("ownership %q, want %q", got, relay.OwnPartitions)
	}
	f.Settle(2)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return r.Stats().Published == 2 }, "nothing published")
}

// An auto relay stopped by ErrMixedOwnership (it chose at the moment a
// relay of the other ownership started) chooses again when run again, and
// follows the relay it met.
func TestAutoOwnershipChoosesAgainAfterMixedOwnership(t *testing.T) {
	f := newFixture(t)
	cfg := f.RelayConfigOf("auto", relay.OwnAuto)
	auto := f.NewRelay(cfg, nil)
	// Its choice, made while no relay ran: partitions.
	if _, err := relaytest.DrainBatch(f.Ctx, auto); err != nil {
		t.Fatal(err)
	}
	if got := auto.Ownership(); got != relay.OwnPartitions {
		t.Fatalf("alone the auto relay chose %q", got)
	}
	runningRelay(relay.OwnRows)(f)
	ctx, cancel := context.WithTimeout(f.Ctx, 20*time.Second)
	defer cancel()
	if err := auto.Run(ctx); !errors.Is(err, relay.ErrMixedOwnership) {
		t.Fatalf("beside a row claimer, having chosen partitions: %v, want ErrMixedOwnership", err)
	}
	f.Run(auto.Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return auto.Stats().ListenUp }, "run again, the auto relay never listened")
	if got := auto.Ownership(); got != relay.OwnRows {
		t.Fatalf("run again beside a row claimer, the auto relay runs %q", got)
	}
}

// Two relays of different ownerships started at the same moment: the
// check after each LISTEN connection catches the one the start-up check
// missed, and no two of them run on together.
func TestRelaysOfBothOwnershipsStartedAtOnce(t *testing.T) {
	f := newFixture(t)
	rows := f.NewRelay(f.RowsRelayConfig("rows"), nil)
	parts := f.NewRelay(f.PartitionRelayConfig("parts"), nil)
	ctx, cancel := context.WithTimeout(f.Ctx, 30*time.Second)
	defer cancel()
	errs := make(chan error, 2)
	for _, r := range []*relay.Relay{rows, parts} {
		go func() { errs <- r.Run(ctx) }()
	}
	err := <-errs
	if !errors.Is(err, relay.ErrMixedOwnership) {
		t.Fatalf("the first relay to return: %v, want ErrMixedOwnership", err)
	}
	// The other one runs alone, or stopped the same way.
	select {
	case err := <-errs:
		if !errors.Is(err, relay.ErrMixedOwnership) {
			t.Fatalf("the second relay returned %v", err)
		}
	case <-time.After(2 * time.Second):
		cancel()
		if err := <-errs; err != nil {
			t.Fatalf("the relay left running: %v", err)
		}
	}
}

// A switch from row claims to partition leases: a claimer died holding a
// key's first event as 'publishing'. The partition owner returns it to
// pending at once (no claimer is alive), and the key's next event is not
// published before it.
func TestPartitionOwnerTakesADeadClaimersRowsBackInOrder(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	var ids []uuid.UUID
	for range 2 {
		err := pgx.BeginFunc(f.Ctx, f.Pool, func(tx pgx.Tx) error {
			w, err := outbox.Write(f.Ctx, tx, outbox.Message{AggregateType: "transfer", AggregateID: uuid.NewString(),
				EventType: "transfer.settled", PartitionKey: "sender-1", Payload: []byte(`{}`)})
			if err == nil {
				ids = append(ids, w[0].ID)
			}
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	f.Exec(`UPDATE outbox_messages SET status = 'publishing', claimed_at = now(), claimed_by = 'dead-claimer',
	        claim_token = gen_random_uuid() WHERE id = $1`, ids[0])
	r := f.NewRelay(f.PartitionRelayConfig("owner"), nil) // its lease, 30s, far away
	f.Run(r.Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return len(f.Entries(f.Stream())) == 2 },
		"the dead claimer's row and the next one were not both published: %v", f.Entries(f.Stream()))
	if got := f.Entries(f.Stream()); got[0] != ids[0].String() || got[1] != ids[1].String() {
		t.Fatalf("stream %v, want the dead claimer's row %s first", got, ids[0])
	}
}
