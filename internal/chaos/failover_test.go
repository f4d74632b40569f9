package chaos

import (
	"testing"
	"time"
)

// A kill costs what the events it touched waited for it, up to the start of
// another fault that held them up further; a kill alone that held events up
// is charged with the whole wait.
func TestFaultCostLeavesOutWaitsThroughAnotherFault(t *testing.T) {
	t0 := time.Date(2026, 12, 2, 19, 59, 35, 0, time.UTC)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	kill := FaultRecord{Kind: KillConsumer, Start: at(0), End: at(0), Back: at(0)}
	master := FaultRecord{Kind: "master-kill", Start: at(500 * time.Millisecond), End: at(17 * time.Second), Back: at(17 * time.Second)}
	events := []eventTiming{
		{ID: "held-by-the-master", Commit: at(-100 * time.Millisecond), Publish: at(-90 * time.Millisecond)},
		{ID: "after-the-kill", Commit: at(200 * time.Millisecond), Publish: at(210 * time.Millisecond)},
	}
	effects := map[string]time.Time{"held-by-the-master": at(9 * time.Second), "after-the-kill": at(400 * time.Millisecond)}

	_, _, effect, ev := faultCost([]FaultRecord{kill, master}, 0, events, effects)
	if ev != "held-by-the-master" || effect != 600*time.Millisecond {
		t.Fatalf("kill's cost %s (event %q), want 600ms (held-by-the-master, until the master's fault began)", effect, ev)
	}
	_, _, effect, ev = faultCost([]FaultRecord{kill}, 0, events, effects)
	if ev != "held-by-the-master" || effect != 9100*time.Millisecond {
		t.Fatalf("kill alone: cost %s (event %q), want 9.1s (held-by-the-master)", effect, ev)
	}
}
