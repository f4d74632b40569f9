package relay

import "github.com/google/uuid"

// Observer is told what a relay does with each batch: the event ids it
// claimed (with partition leases: read), and those Redis took, right after
// the XADDs and before the mark (a crash in between publishes them again,
// and tells it again). Its methods run on the relay's drain goroutine: keep
// them fast. The demo draws its timelines with it.
type Observer interface {
	Claimed(ids []uuid.UUID)
	Published(ids []uuid.UUID)
}

// Hooks is an Observer made of functions; a nil one is not called.
type Hooks struct {
	OnClaim, OnPublish func(ids []uuid.UUID)
}

// Claimed calls h.OnClaim, if set.
func (h Hooks) Claimed(ids []uuid.UUID) {
	if h.OnClaim != nil {
		h.OnClaim(ids)
	}
}

// Published calls h.OnPublish, if set.
func (h Hooks) Published(ids []uuid.UUID) {
	if h.OnPublish != nil {
		h.OnPublish(ids)
	}
}
