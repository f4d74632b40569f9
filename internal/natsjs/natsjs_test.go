package natsjs

import (
	"errors"
	"fmt"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Down tells the server's troubles (a relay counts no attempt against the
// events) from a message's own.
func TestDownClassifiesTheServersTroubles(t *testing.T) {
	for _, err := range []error{
		nats.ErrTimeout, nats.ErrConnectionClosed, nats.ErrNoResponders, jetstream.ErrNoStreamResponse,
		jetstream.ErrTooManyStalledMsgs, fmt.Errorf("publish: %w", jetstream.ErrTooManyStalledMsgs),
		&jetstream.APIError{Code: 503, Description: "JetStream system temporarily unavailable"},
	} {
		if !Down(err) {
			t.Errorf("Down(%v) = false, want true: the server's, not the message's", err)
		}
	}
	for _, err := range []error{nil, errors.New("message too large"), &jetstream.APIError{Code: 400, Description: "bad request"}} {
		if Down(err) {
			t.Errorf("Down(%v) = true, want false", err)
		}
	}
}
