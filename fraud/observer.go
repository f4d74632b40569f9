package fraud

// Outcome is what one delivery of a valid event came to.
type Outcome int

const (
	// OutcomeDuplicate: the event was applied before (its dedupe marker
	// is set); nothing was applied this time.
	OutcomeDuplicate Outcome = iota
	// OutcomeApprove: applied; the transfer's verdict is approve.
	OutcomeApprove
	// OutcomeReview: applied; the transfer's verdict is review.
	OutcomeReview
)

// String is the outcome's name: "duplicate", "approve" or "review" (the
// verdict, and the metrics' label).
func (o Outcome) String() string {
	switch o {
	case OutcomeDuplicate:
		return "duplicate"
	case OutcomeApprove:
		return "approve"
	case OutcomeReview:
		return "review"
	}
	return "unknown"
}

// Observer is told of every delivery of a valid event once its effect is
// applied or skipped as a duplicate, before the entry is acknowledged (a
// crash after the effect and before the XACK tells it twice: the second
// time as OutcomeDuplicate). Processed runs on the goroutine of the event's
// partition (with several partitions, concurrently): it must be safe for
// that, and fast. The demo draws its timelines with it; a service can count
// or trace with it.
type Observer interface {
	Processed(ev Event, o Outcome)
}

// ObserverFunc is an Observer made of a function.
type ObserverFunc func(ev Event, o Outcome)

// Processed calls f.
func (f ObserverFunc) Processed(ev Event, o Outcome) { f(ev, o) }
