package outbox_test

import (
	"fmt"
	"maps"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/failpoint"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/relaytest"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/transfer"
)

// stallBound is how long after its commit an event may reach the stream
// while a relay is stalled. The bound is 2 s; the rest is slack for
// a loaded machine under -race. The stall lasts stallFor, longer than the
// bound: an event held by the stalled relay until it wakes fails it.
const (
	stallBound = 3 * time.Second
	stallFor   = 6 * time.Second
)

// A relay that stalls (SIGSTOP: a VM pause, a long GC, swap) with its
// connections open, while another relay runs and TEDs settle at 100/s: the
// other relay sees its LISTEN connection go quiet and takes its claims or
// partition slots over within about a second, not at the end of the stall
// (or of the 30 s lease). The stalled relay stops right after a claim, with
// a batch in hand; woken, it goes on: its late publish is a duplicate and
// its mark is fenced. Every event reaches the stream within stallBound of
// its commit, and each sender's first in settled order.
func TestStalledRelayIsTakenOverWithinASecond(t *testing.T) {
	for _, ownership := range []string{relay.OwnRows, relay.OwnPartitions} {
		t.Run(ownership, func(t *testing.T) {
			f := newFixture(t)
			b := f.NewRelay(f.RelayConfigOf("relay-b", ownership), nil)
			f.Run(b.Run)
			outboxtest.Eventually(t, 10*time.Second, func() bool { return b.Stats().ListenUp }, "relay-b not listening")

			cmd, exited := startStalling(t, f.OutboxCmd("relay.after-claim", "relay", "--name", "relay-a",
				"--stream-prefix", f.StreamPrefix(), "--ownership", ownership), "relay-a")
			outboxtest.Eventually(t, 20*time.Second, func() bool {
				if ownership == relay.OwnPartitions {
					h := f.LeaseHolders()
					return h["relay-a"] == 8 && h["relay-b"] == 8
				}
				return f.Count("SELECT count(*) FROM outbox_live_relays") == 2
			}, "relay-a did not join relay-b")

			// 100 TEDs a second of 20 senders, until told to stop.
			committed, stopWrite, written := settleSteadily(t, f, 10*time.Millisecond)
			// relay-a stops at its first claim of rows, its batch in hand.
			outboxtest.Eventually(t, 20*time.Second, func() bool { return processStopped(cmd.Process.Pid) },
				"relay-a never stopped at its claim")
			time.Sleep(stallFor)
			if err := cmd.Process.Signal(syscall.SIGCONT); err != nil {
				t.Fatal(err)
			}
			time.Sleep(time.Second) // it goes on, beside relay-b
			close(stopWrite)
			<-written
			select {
			case <-exited:
				t.Fatal("relay-a exited after it was continued")
			default:
			}

			all := committed()
			outboxtest.Eventually(t, 30*time.Second, func() bool {
				return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == len(all)
			}, "not every event was published")
			first := map[string]time.Time{}   // transfer id -> its first entry's time
			bySender := map[string][]string{} // sender -> transfer ids, in first-entry order
			for _, e := range f.FirstEntries(f.Stream(), "aggregate_id", "partition_key") {
				first[e.ID] = e.At
				bySender[e.Key] = append(bySender[e.Key], e.ID)
			}
			checkWaits(t, "commit to stream", all, first)
			// Each sender's TEDs first appear in settled (seq) order.
			checkSendersOrder(t, f, bySender, "first entries")
		})
	}
}

// processStopped reports whether the process is stopped (SIGSTOP).
func processStopped(pid int) bool {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// pid (comm) state ...: the state follows the last ')'.
	s := string(stat)
	i := strings.LastIndexByte(s, ')')
	return i >= 0 && i+2 < len(s) && s[i+2] == 'T'
}

// A consumer that stalls (SIGSTOP) right after it read a batch, holding a
// partition and entries it has not applied, while another consumer runs and
// TEDs settle at 100/s: the other sees its heartbeat stop and takes its
// partition over within about a second, not when the stall or the 10 s
// partition lease ends. Woken, the stalled consumer goes on: its effects are
// fenced, it rejoins the group. Every TED is judged once, each sender's in
// settled order, within stallBound of its commit.
func TestStalledConsumerIsTakenOverWithinASecond(t *testing.T) {
	f := newFixture(t)
	f.partitions = 2
	rcfg := f.RelayConfig("relay")
	rcfg.Partitions = 2
	f.Run(f.NewRelay(rcfg, nil).Run)
	const auditLen = 100_000
	alive := f.consumer("alive", func(c *fraud.Config) {
		c.Partitions, c.AuditLen = 2, auditLen
		c.ClaimInterval, c.ClaimMinIdle, c.PartitionLease = 0, 0, 0 // the defaults: 5 s, 30 s, 10 s
	})
	f.Run(alive.Run)
	cmd, exited := startStalling(t, f.OutboxCmd("fraud.after-read", "fraud", "--stream", f.Stream(), "--key-prefix", f.keyPrefix(),
		"--consumer", "stalled", "--partitions", "2", "--block", "100ms", "--audit-len", strconv.Itoa(auditLen)), "the stalled consumer")
	f.waitForPartitionOf("stalled")

	committed, stopWrite, written := settleSteadily(t, f, 10*time.Millisecond)
	outboxtest.Eventually(t, 20*time.Second, func() bool { return processStopped(cmd.Process.Pid) },
		"the consumer never stopped after its read")
	time.Sleep(stallFor)
	if err := cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second) // it goes on, beside the other
	close(stopWrite)
	<-written
	select {
	case <-exited:
		t.Fatal("the stalled consumer exited after it was continued")
	default:
	}

	teds := f.settled()
	outboxtest.Eventually(t, 30*time.Second, func() bool { return f.report().Verdicts >= int64(len(teds)) },
		"not every TED was judged")
	f.checkEffectsOnce(teds)
	// When each was applied: its audit entry's time (written with the effect).
	applied, bySender := auditTimes(f)
	checkWaits(t, "commit to effect", committed(), applied)
	checkSendersOrder(t, f, bySender, "applied")
}

// waitForPartitionOf waits until the anti-fraud consumer named consumer
// holds a partition lease.
func (f *fixture) waitForPartitionOf(consumer string) {
	f.T.Helper()
	outboxtest.Eventually(f.T, 20*time.Second, func() bool {
		for _, k := range f.keys().Each() {
			if v, _ := f.Redis.Get(f.Ctx, k.Lease("fraud")).Result(); strings.Contains(v, "|"+consumer+"|") {
				return true
			}
		}
		return false
	}, "the consumer process %s took no partition", consumer)
}

// startStalling starts cmd, an outbox process armed to stop itself at a fail
// point (OUTBOX_FAILPOINT_ACTION=stop), and returns it with a channel closed
// when it exits (startOutbox).
func startStalling(t *testing.T, cmd *exec.Cmd, who string) (*exec.Cmd, <-chan struct{}) {
	t.Helper()
	cmd.Env = append(cmd.Env, failpoint.ActionEnvVar+"=stop")
	exited, _ := startOutbox(t, cmd, who)
	return cmd, exited
}

// startOutbox starts cmd, an outbox process, and returns a channel closed
// when it exits and its output; when the test ends it is continued (were it
// stopped), killed, and its output (who's) shown if the test failed.
func startOutbox(t *testing.T, cmd *exec.Cmd, who string) (<-chan struct{}, *relaytest.SyncBuffer) {
	t.Helper()
	out := new(relaytest.SyncBuffer)
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGCONT)
		_ = cmd.Process.Kill()
		<-exited
		if t.Failed() {
			t.Logf("%s's output:\n%s", who, out.Bytes())
		}
	})
	return exited, out
}

// auditTimes reads anti-fraud's audit streams (an entry written with each
// effect): when each transfer was first applied, and each sender's
// transfers in the order first applied.
func auditTimes(f *fixture) (applied map[string]time.Time, bySender map[string][]string) {
	applied, bySender = map[string]time.Time{}, map[string][]string{}
	for _, k := range f.keys().Each() {
		for _, e := range f.FirstEntries(k.Audit(), "transfer_id", "from_account") {
			applied[e.ID] = e.At
			bySender[e.Key] = append(bySender[e.Key], e.ID)
		}
	}
	return applied, bySender
}

// settleSteadily settles a TED of one of 20 senders every tick until stop
// is closed (written is closed then), and returns the transfer ids with a
// moment before each one's commit.
func settleSteadily(t *testing.T, f *fixture, tick time.Duration) (committed func() map[string]time.Time, stop, written chan struct{}) {
	var mu sync.Mutex
	at := map[string]time.Time{}
	stop, written = make(chan struct{}), make(chan struct{})
	go func() {
		defer close(written)
		tk := time.NewTicker(tick)
		defer tk.Stop()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-tk.C:
			}
			ted := transfer.Transfer{ID: uuid.New(), FromAccount: fmt.Sprintf("stall-%02d", i%20), ToAccount: "dest", AmountCents: 100}
			before := time.Now()
			if _, err := transfer.Settle(f.Ctx, f.Pool, ted); err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			at[ted.ID.String()] = before
			mu.Unlock()
		}
	}()
	return func() map[string]time.Time {
		mu.Lock()
		defer mu.Unlock()
		return maps.Clone(at)
	}, stop, written
}

// checkWaits fails t if a transfer of committed reached its step (at) more
// than stallBound after its commit, or never did, and logs the waits.
func checkWaits(t *testing.T, step string, committed, at map[string]time.Time) {
	t.Helper()
	var waits []time.Duration
	var late []string
	for id, c := range committed {
		a, ok := at[id]
		if !ok {
			t.Fatalf("transfer %s never reached %s", id, step)
		}
		w := a.Sub(c)
		waits = append(waits, w)
		if w > stallBound {
			late = append(late, fmt.Sprintf("%s after %s", id, w.Round(time.Millisecond)))
		}
	}
	slices.Sort(waits)
	t.Logf("%d TEDs, stalled %s: %s median %s, p99 %s, max %s", len(waits), stallFor, step,
		waits[len(waits)/2].Round(time.Millisecond), waits[len(waits)*99/100].Round(time.Millisecond),
		waits[len(waits)-1].Round(time.Millisecond))
	if len(late) > 0 {
		t.Errorf("%d of %d TEDs reached %s more than %s after their commit: %v", len(late), len(waits), step, stallBound, late)
	}
}

// checkSendersOrder fails t if a sender's transfers in bySender (first
// occurrences, in the order they were published or applied) are not in the
// order they were settled.
func checkSendersOrder(t *testing.T, f *fixture, bySender map[string][]string, what string) {
	t.Helper()
	for sender, ids := range bySender {
		var want []string
		rows, err := f.Pool.Query(f.Ctx, `SELECT aggregate_id FROM outbox_messages WHERE partition_key = $1 ORDER BY seq`, sender)
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var id string
			if err := rows.Scan(&id); err != nil {
				t.Fatal(err)
			}
			want = append(want, id)
		}
		var got []string
		for _, id := range ids {
			if !slices.Contains(got, id) {
				got = append(got, id)
			}
		}
		if !slices.Equal(got, want) {
			t.Errorf("sender %s: %s out of order:\n got %v\nwant %v", sender, what, got, want)
		}
	}
}
