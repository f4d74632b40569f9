package outbox_test

import (
	"errors"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/relaytest"
)

// Failover: a relay process that dies is taken over the moment its database
// connections close, not when its leases (30 s by default) run out
// (sql/migrations/0012_relay_liveness.sql). Each test runs the real binary,
// SIGKILLs it, and bounds the takeover well below the lease.

// failoverBound is what these tests allow for a takeover: the relays look
// four times a second; the rest is slack for a loaded CI machine. The lease
// is 30 s: a takeover that waited for it fails.
const failoverBound = 5 * time.Second

// A relay killed right after it claimed a batch, another relay asleep: the
// other relay returns the dead one's claims to pending and publishes them
// at once.
func TestRowClaimerKilledHoldingABatchIsTakenOverAtOnce(t *testing.T) {
	f := newFixture(t)
	// Writers do not notify: the survivor learns of the rows only from the
	// takeover (its poll is ten minutes away).
	f.Exec("SELECT outbox_notify_mode('off')")
	b := f.NewRelay(f.RowsRelayConfig("relay-b"), nil)
	f.Run(b.Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool { return b.Stats().ListenUp }, "relay-b not listening")
	time.Sleep(time.Second) // its start-up drains are over: it sleeps
	teds := f.Settle(20)

	// relay-a claims at its first drain, which waits for its LISTEN
	// connection 2 s at most: on a loaded machine it may claim before that
	// connection is up, and such claims carry no pid, which no watch can
	// find dead (their lease returns them, and relay-a's next connection,
	// had it lived, would have). That is not the case under test: give
	// those rows back as they were and run relay-a again.
	var killed time.Time
	for attempt := 1; ; attempt++ {
		f.RunUntilKilled(f.OutboxCmd("relay.after-claim", "relay", "--name", "relay-a", "--ownership", "rows",
			"--stream-prefix", f.StreamPrefix()))
		killed = time.Now()
		pidless := f.Count(`SELECT count(*) FROM outbox_messages WHERE status = 'publishing' AND claimed_by = 'relay-a' AND claimed_pid IS NULL`)
		if pidless == 0 {
			break
		}
		if attempt == 3 {
			t.Fatalf("relay-a claimed before its LISTEN connection was up in %d runs in a row", attempt)
		}
		t.Logf("run %d: relay-a claimed %d rows before its LISTEN connection was up; again", attempt, pidless)
		f.Exec(`UPDATE outbox_messages SET status = 'pending', claimed_by = NULL, claimed_at = NULL, claim_token = NULL
			WHERE status = 'publishing' AND claimed_by = 'relay-a'`)
	}
	// relay-a's claims: still publishing, or already returned by relay-b
	// (it looks four times a second, and may be quicker than this query).
	if n := f.Count(`SELECT count(*) FROM outbox_messages WHERE (status = 'publishing' AND claimed_by = 'relay-a')
	                 OR last_error = 'relay died (claimed by relay-a)'`); n == 0 {
		t.Fatal("relay-a died without a claim: the test proves nothing")
	}
	outboxtest.Eventually(t, failoverBound, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == len(teds)
	}, "the dead relay's claims were not taken over within %s (lease %s)", failoverBound, "30s")
	t.Logf("dead claimer's batch published %s after the kill", time.Since(killed).Round(time.Millisecond))
	if n := f.Count("SELECT count(*) FROM outbox_messages WHERE attempts = 1"); n != len(teds) {
		t.Fatalf("%d of %d rows count the dead relay's claim as an attempt", n, len(teds))
	}
	if got := f.Count("SELECT count(*) FROM outbox_relay_members WHERE owner = 'relay-a'"); got != 0 {
		t.Fatalf("the dead relay is still a member (%d rows)", got)
	}
}

// A partition owner killed and not restarted: the other relay frees and
// takes its slots at once, and publishes the events committed after the kill.
func TestPartitionOwnerKilledIsTakenOverAtOnce(t *testing.T) {
	f := newFixture(t)
	b := f.NewRelay(f.PartitionRelayConfig("relay-b"), nil)
	f.Run(b.Run)
	cmd := f.OutboxCmd("", "relay", "--name", "relay-a", "--stream-prefix", f.StreamPrefix(), "--ownership", "partitions")
	exited, out := startOutbox(t, cmd, "relay-a")
	// Both the slots in the table and relay-a's log line of them: its
	// renewal commits before it logs, and a kill in between would leave
	// the line unwritten.
	outboxtest.Eventually(t, 20*time.Second, func() bool {
		h := f.LeaseHolders()
		return h["relay-a"] == 8 && h["relay-b"] == 8 && strings.Contains(string(out.Bytes()), "partition leases")
	}, "the relays did not share the slots: %v", f.LeaseHolders())
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-exited
	killed := time.Now()
	teds := f.Settle(40) // about half of them in the dead relay's slots
	outboxtest.Eventually(t, failoverBound, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == len(teds)
	}, "the dead owner's slots did not move within %s (lease 30s): holders %v", failoverBound, f.LeaseHolders())
	t.Logf("every event published %s after the kill", time.Since(killed).Round(time.Millisecond))
	if h := f.LeaseHolders(); h["relay-b"] != 16 {
		t.Fatalf("slot holders %v, want relay-b holding all 16", h)
	}
	if !strings.Contains(string(out.Bytes()), "partition leases") {
		t.Fatalf("relay-a never logged its leases:\n%s", out.Bytes())
	}
}

// A consumer process killed right after it read a batch, holding a
// partition and entries it never acknowledged: the other consumer finds its
// Redis connection gone, takes the partition and applies those entries, in
// order and once, long before the partition lease (10 s) or the claim of
// idle entries (30 s) would have.
func TestConsumerKilledHoldingPartitionsIsTakenOverAtOnce(t *testing.T) {
	f := newFixture(t)
	f.partitions = 2
	rcfg := f.RelayConfig("relay")
	rcfg.Partitions = 2
	f.Run(f.NewRelay(rcfg, nil).Run)
	alive := f.consumer("alive", func(c *fraud.Config) {
		c.Partitions = 2
		c.ClaimInterval, c.ClaimMinIdle, c.PartitionLease = 0, 0, 0 // the defaults: 5 s, 30 s, 10 s
	})
	f.Run(alive.Run)
	cmd := f.OutboxCmd("fraud.after-read", "fraud", "--stream", f.Stream(), "--key-prefix", f.keyPrefix(),
		"--consumer", "dead", "--partitions", "2", "--block", "100ms")
	var out relaytest.SyncBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	f.waitForPartitionOf("dead")
	teds := f.Settle(40) // about half of them in its partition
	var killed time.Time
	select {
	case err := <-exited:
		killed = time.Now()
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
			t.Fatalf("want death by SIGKILL after its read, got %v\n%s", err, out.Bytes())
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("the consumer process read nothing\n%s", out.Bytes())
	}
	outboxtest.Eventually(t, failoverBound, func() bool { return f.report().Verdicts == int64(len(teds)) },
		"the dead consumer's partition and entries were not taken over within %s: %+v", failoverBound, f.report())
	t.Logf("every TED judged %s after the kill", time.Since(killed).Round(time.Millisecond))
	f.checkEffectsOnce(teds)
}
