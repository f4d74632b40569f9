package relay_test

import (
	"cmp"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/relay"
)

// Issue 23, case 6: relays claiming rows and relays leasing partitions never
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
			cfg := func(name, ownership string) relay.Config {
				c := f.RelayConfig(name)
				c.Ownership = ownership
				return c
			}
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

// OwnAuto, the default: a relay follows the ownership of the relays running
// on its database, and leases partitions where none runs. So a rolling
// upgrade of relays that claim rows never stops at ErrMixedOwnership.
func TestAutoOwnershipFollowsTheRelaysRunning(t *testing.T) {
	for _, running := range []string{"", relay.OwnRows, relay.OwnPartitions} {
		want := cmp.Or(running, relay.OwnPartitions)
		t.Run("beside "+cmp.Or(running, "no relay"), func(t *testing.T) {
			f := newFixture(t)
			if running != "" {
				c := f.RelayConfig("running")
				c.Ownership = running
				r := f.NewRelay(c, nil)
				f.Run(r.Run)
				outboxtest.Eventually(t, 10*time.Second, func() bool { return r.Stats().ListenUp }, "the running relay never listened")
			}
			cfg := f.RelayConfig("auto")
			cfg.Ownership = ""
			auto := f.NewRelay(cfg, nil)
			if got := auto.Config().Ownership; got != relay.OwnAuto {
				t.Fatalf("default ownership %q, want %q", got, relay.OwnAuto)
			}
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
			if got := auto.Ownership(); got != want {
				t.Fatalf("beside %q the auto relay runs %q, want %q", running, got, want)
			}
			// It runs on: the check after its LISTEN connection found no
			// relay of the other ownership.
			select {
			case err := <-done:
				t.Fatalf("the auto relay stopped: %v", err)
			case <-time.After(500 * time.Millisecond):
			}
			if want == relay.OwnRows {
				if held := f.LeaseHolders()["auto"]; held != 0 {
					t.Fatalf("the auto relay claims rows and holds %d partition slots", held)
				}
				return
			}
			// A partition owner takes its share (beside a relay holding
			// every slot, once that one gave half back).
			outboxtest.Eventually(t, 15*time.Second, func() bool { return f.LeaseHolders()["auto"] > 0 },
				"the auto relay leases partitions and holds no slot")
		})
	}
}

// A relay left to choose its ownership waits for a database that does not
// answer, and returns nil when stopped before it could start.
func TestAutoOwnershipWaitsForTheDatabase(t *testing.T) {
	f := newFixture(t)
	pcfg, err := pgxpool.ParseConfig("postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.NewWithConfig(f.Ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	cfg := f.RelayConfig("auto")
	cfg.Ownership = relay.OwnAuto
	r, err := relay.New(pool, f.Redis.Client, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(f.Ctx, 1500*time.Millisecond)
	defer cancel()
	if err := r.Run(ctx); err != nil {
		t.Fatalf("Run stopped while choosing its ownership: %v, want nil", err)
	}
	if got := r.Ownership(); got != "" {
		t.Fatalf("ownership %q chosen without a database", got)
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
