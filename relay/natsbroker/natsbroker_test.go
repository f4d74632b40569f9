package natsbroker

import (
	"context"
	"errors"
	"fmt"
	"net"
	"syscall"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/tedbank/outbox/relay/broker"
)

// The publishing tests run against a real server with the relay's fixture
// (relay/jetstream_test.go, internal/conformance); these are the broker's
// classifications of its errors.
func TestErrors(t *testing.T) {
	b := &Broker{}
	for _, c := range []struct {
		err                    error
		unavailable, maybeSent bool
	}{
		{nats.ErrNoResponders, true, false},
		{nats.ErrConnectionClosed, true, false},
		// A publish awaiting its ack when the connection was replaced.
		{fmt.Errorf("publish: %w", nats.ErrDisconnected), true, true},
		{fmt.Errorf("publish: %w", jetstream.ErrStreamNotFound), true, false},
		{&net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}, true, false},
		{fmt.Errorf("%w: no acknowledgement: %w", broker.ErrUnavailable, context.DeadlineExceeded), true, true},
		{errors.New("nats: maximum payload exceeded"), false, true},
	} {
		if got := b.Unavailable(c.err); got != c.unavailable {
			t.Errorf("Unavailable(%v) = %v, want %v", c.err, got, c.unavailable)
		}
		if got := b.MaybeSent(c.err); got != c.maybeSent {
			t.Errorf("MaybeSent(%v) = %v, want %v", c.err, got, c.maybeSent)
		}
	}
	if _, err := New(Config{}); err == nil {
		t.Fatal("New without a JetStream context: no error")
	}
}
