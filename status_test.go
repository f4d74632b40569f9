package outbox_test

import (
	"encoding/json"
	"errors"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/status"
)

// outbox status tells the truth about a deployment whose processes are
// SIGKILLed: exit 0 while it delivers; exit 1 naming the dead relays that
// hold their slots, the dead consumer that holds its partition and the
// events that wait; exit 0 again once new processes have taken over.
func TestStatusAfterRelaysAreKilled(t *testing.T) {
	f := newFixture(t)
	relay := func(name string) (*exec.Cmd, <-chan struct{}) {
		cmd := f.OutboxCmd("", "relay", "--name", name, "--stream-prefix", f.StreamPrefix(), "--ownership", "partitions")
		exited, _ := startOutbox(t, cmd, name)
		return cmd, exited
	}
	consumer := func(name string) (*exec.Cmd, <-chan struct{}) {
		cmd := f.OutboxCmd("", "fraud", "--stream", f.Stream(), "--key-prefix", f.keyPrefix(), "--consumer", name)
		exited, _ := startOutbox(t, cmd, name)
		return cmd, exited
	}
	statusOf := func() (int, status.Status) {
		t.Helper()
		out, err := f.OutboxCmd("", "status", "--json", "--stream", f.Stream(), "--key-prefix", f.keyPrefix()).Output()
		code := 0
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			code = exit.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		var st status.Status
		if err := json.Unmarshal(out, &st); err != nil {
			t.Fatalf("status: %v\n%s", err, out)
		}
		return code, st
	}
	var code int
	var st status.Status
	problems := func() any { return st.Problems }

	r1, r1Exited := relay("r1")
	r2, r2Exited := relay("r2")
	c1, c1Exited := consumer("c1")
	f.Settle(20)
	outboxtest.Eventually(t, 20*time.Second, func() bool {
		code, st = statusOf()
		return code == 0 && st.Published == 20 && st.RelaySlots["r1"] == 8 && st.RelaySlots["r2"] == 8 && st.LiveMembers == 1 &&
			st.GroupLag == 0 && st.GroupPending == 0
	}, "the deployment did not deliver and say so: %q", problems)

	for _, p := range []struct {
		cmd    *exec.Cmd
		exited <-chan struct{}
	}{{r1, r1Exited}, {r2, r2Exited}, {c1, c1Exited}} {
		if err := p.cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		<-p.exited
	}
	f.Settle(5)
	code, st = statusOf()
	for _, want := range []string{
		"no live relay while 5 events wait",
		"relay r1 is dead and holds 8 partition slots",
		"relay r2 is dead and holds 8 partition slots",
		"partition 0 of group fraud is held by c1, which is dead",
	} {
		if !hasProblem(st, want) {
			t.Errorf("problems %q lack %q", st.Problems, want)
		}
	}
	if code != 1 || st.Healthy || st.LiveRelays != 0 || st.LiveMembers != 0 {
		t.Fatalf("after the kills: exit %d, %+v", code, st)
	}

	relay("r3")
	consumer("c2")
	// Healthy again once the new relay and consumer have buried the dead
	// ones (r1, r2 and c1 gone), taken their slots and partition, and
	// delivered what waited.
	outboxtest.Eventually(t, 20*time.Second, func() bool {
		code, st = statusOf()
		return code == 0 && st.Published == 25 && st.GroupLag == 0 && st.GroupPending == 0 &&
			len(st.Relays) == 1 && st.Relays[0].Name == "r3" && st.RelaySlots["r3"] == 16 &&
			st.ByPartition[0].Owner == "c2" && st.ByPartition[0].OwnerAlive
	}, "the new relay and consumer did not take over: exit %d, problems %q, relays %+v, slots %v, partition %+v",
		func() any { return code }, problems, func() any { return st.Relays }, func() any { return st.RelaySlots },
		func() any { return st.ByPartition })
	outboxtest.Eventually(t, 20*time.Second, func() bool { return f.report().Verdicts == 25 }, "not every TED judged")
}

func hasProblem(st status.Status, part string) bool {
	for _, p := range st.Problems {
		if strings.Contains(p, part) {
			return true
		}
	}
	return false
}
