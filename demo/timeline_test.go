package demo

import (
	"testing"
	"time"
)

// A timeline prints its steps in the order they happened: the NOTIFY (and
// even the claim) can come before Settle's reply reaches the caller.
func TestTimelinePrintsStepsInTheOrderTheyHappened(t *testing.T) {
	t.Parallel()
	start := time.Now()
	at := func(ms float64) time.Time { return start.Add(time.Duration(ms * float64(time.Millisecond))) }
	tl := timeline{start: start}
	tl.at[stepCommitted], tl.at[stepNotified], tl.at[stepClaimed] = at(2.36), at(1.99), at(2.5)
	tl.at[stepPublished], tl.at[stepVerdict] = at(3.1), at(4.75)
	if got, want := tl.String(), "notified 1.99 → settled 2.36 → claimed 2.50 → published 3.10 → judged 4.75 ms"; got != want {
		t.Errorf("got  %q\nwant %q", got, want)
	}
	tl.at[stepNotified] = time.Time{} // not seen: left out
	if got, want := tl.String(), "settled 2.36 → claimed 2.50 → published 3.10 → judged 4.75 ms"; got != want {
		t.Errorf("without a notification: got %q, want %q", got, want)
	}
}
