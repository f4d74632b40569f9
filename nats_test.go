package outbox_test

import (
	"encoding/json"
	"github.com/tedbank/outbox/consumer/natssource"
	"os/exec"
	"testing"
	"time"

	"github.com/tedbank/outbox/internal/natsjs"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/relaytest"
	"github.com/tedbank/outbox/ledger"
)

// natsCmd is an outbox command on NATS: the broker chosen by the
// environment (OUTBOX_BROKER, NATS_URL), as a deployment would.
func (f *fixture) natsCmd(failpoint string, args ...string) *exec.Cmd {
	cmd := f.OutboxCmd(failpoint, args...)
	cmd.Env = append(cmd.Env, "OUTBOX_BROKER=nats", "NATS_URL="+outboxtest.NATSURL(f.T))
	return cmd
}

// startCmds starts cmds, stopped when the test ends.
func startCmds(t *testing.T, cmds ...*exec.Cmd) {
	t.Helper()
	for _, c := range cmds {
		var out relaytest.SyncBuffer
		c.Stdout, c.Stderr = &out, &out
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_ = c.Process.Kill()
			_ = c.Wait()
			if t.Failed() {
				t.Logf("%v:\n%s", c.Args, out.Bytes())
			}
		})
	}
}

// On NATS JetStream (--broker nats) the whole path holds through the real
// commands: the relay publishes each TED, anti-fraud judges each once and
// keeps its effects in Redis (its report unchanged), the ledger posts each
// once, status reads the JetStream side, and SIGTERM stops them cleanly.
func TestEndToEndOnNATS(t *testing.T) {
	t.Parallel()
	f := newLedgerFixture(t)
	stream := outboxtest.NATSStream(t)
	relayCmd := f.natsCmd("", "relay", "--nats-stream", stream, "--stream-prefix", f.StreamPrefix(), "--poll", "1m")
	fraudCmd := f.natsCmd("", "fraud", "--stream", f.Stream(), "--key-prefix", f.keyPrefix(), "--consumer", "c1", "--block", "200ms")
	ledgerCmd := f.natsCmd("", f.ledgerArgs("l1")...)
	startCmds(t, relayCmd, fraudCmd, ledgerCmd)

	teds := f.Settle(60)
	outboxtest.Eventually(t, 30*time.Second, func() bool { return f.report().Verdicts == 60 }, "not every TED judged")
	f.checkEffectsOnce(teds)
	f.waitPosted(teds, func() int64 {
		out, err := f.natsCmd("", "status", "--json", "--stream", f.Stream(), "--group", ledger.DefaultGroup, "--key-prefix", f.Redis.Prefix+"ledger:").Output()
		if err != nil {
			return -1
		}
		var st struct {
			GroupPending int64 `json:"group_pending"`
			GroupLag     int64 `json:"group_lag"`
		}
		if json.Unmarshal(out, &st) != nil {
			return -1
		}
		return st.GroupPending + st.GroupLag
	})
	f.checkPostedOnce(teds)

	out, err := f.natsCmd("", "status", "--json", "--stream", f.Stream(), "--key-prefix", f.keyPrefix()).Output()
	if err != nil {
		t.Fatalf("status: %v\n%s", err, out)
	}
	var st map[string]any
	if err := json.Unmarshal(out, &st); err != nil {
		t.Fatal(err)
	}
	if st["broker"] != "nats" || st["published"] != float64(60) || st["stream_length"] != float64(60) ||
		st["group_pending"] != float64(0) || st["group_lag"] != float64(0) || st["group_exists"] != true {
		t.Fatalf("status on NATS: %s", out)
	}
	for name, c := range map[string]*exec.Cmd{"relay": relayCmd, "fraud": fraudCmd, "ledger": ledgerCmd} {
		stopWithSIGTERM(t, name, c)
	}
}

// The ledger on NATS, SIGKILLed after committing a batch and before
// acknowledging it, and restarted under its name, posts each TED once: the
// new owner re-reads the unacknowledged messages first and finds them in
// its inbox.
func TestLedgerOnNATSCrashAfterCommitPostsOnce(t *testing.T) {
	f := newLedgerFixture(t)
	stream := outboxtest.NATSStream(t)
	startCmds(t, f.natsCmd("", "relay", "--nats-stream", stream, "--stream-prefix", f.StreamPrefix(), "--poll", "1m"))
	teds := f.Settle(6)
	outboxtest.Eventually(t, 15*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 6
	}, "not published")
	f.RunUntilKilled(f.natsCmd("ledger.after-effect", f.ledgerArgs("c1")...))
	posted := 0
	for _, n := range f.postings(teds) {
		posted += n
	}
	if posted != 6 {
		t.Fatalf("%d posted when the ledger died after its commit, want 6", posted)
	}
	nc, js, err := natsjs.Connect(outboxtest.NATSURL(t), "outbox-test")
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	c, err := ledger.NewWithSource(f.ledgerDB, f.Redis.Client, natssource.New(js), f.ledgerConfig("c1"))
	if err != nil {
		t.Fatal(err)
	}
	f.Run(c.Run)
	outboxtest.Eventually(t, 15*time.Second, func() bool { return c.Stats().Duplicates == 6 },
		"stats %+v: the restarted ledger did not find the 6 committed postings in its inbox", c.Stats())
	f.checkPostedOnce(teds)
}
