// Package natsjs is what the relay and the consumers share about NATS
// JetStream, the second broker (--broker nats): how to connect, and the
// JetStream stream that holds the relay's subjects.
//
// The wire format mirrors the Redis stream entries' (package relay/entry):
// the subject is the relay's stream name (StreamPrefix + aggregate type, with
// the partition's suffix), the body is the event's payload, and every other
// field of relay/entry travels as a header of the same name. Nats-Msg-Id is
// the event id: the server drops a re-publication within the stream's
// duplicate window, and consumers deduplicate the rest.
package natsjs

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Defaults of Stream.
const (
	DefaultStream     = "OUTBOX"
	DefaultDuplicates = 2 * time.Minute
	DefaultMaxAge     = 7 * 24 * time.Hour
)

// Stream is the JetStream stream of the relay's subjects.
type Stream struct {
	// Name is the stream's name. Default DefaultStream.
	Name string
	// SubjectPrefix is the relay's stream prefix: the stream captures
	// SubjectPrefix + ">".
	SubjectPrefix string
	// Duplicates is the server's duplicate window: a message whose
	// Nats-Msg-Id was stored within it is dropped. Default 2 minutes.
	Duplicates time.Duration
	// MaxAge is how long a message is kept, acknowledged or not: a consumer
	// stopped for longer loses what it had not read. Default 7 days.
	MaxAge time.Duration
	// Replicas is the stream's replication in a clustered JetStream.
	// Default 1.
	Replicas int
}

func (s Stream) withDefaults() Stream {
	s.Name = cmp.Or(s.Name, DefaultStream)
	s.Duplicates = cmp.Or(s.Duplicates, DefaultDuplicates)
	s.MaxAge = cmp.Or(s.MaxAge, DefaultMaxAge)
	s.Replicas = cmp.Or(s.Replicas, 1)
	return s
}

// Validate reports a setting that cannot work, after defaults.
func (s Stream) Validate() error {
	s = s.withDefaults()
	switch {
	case strings.ContainsAny(s.Name, " \t.*>/\\") || s.Name == "":
		return fmt.Errorf("JetStream stream name %q: no spaces, dots, '*', '>' or slashes", s.Name)
	case !strings.HasSuffix(s.SubjectPrefix, ".") || strings.ContainsAny(s.SubjectPrefix, " \t*>"):
		return fmt.Errorf("subject prefix %q (the relay's stream prefix): must end with '.', so that the stream holds %s>, "+
			"and have no spaces or wildcards", s.SubjectPrefix, s.SubjectPrefix)
	case s.Duplicates < time.Second || s.MaxAge < s.Duplicates:
		return fmt.Errorf("duplicate window %s / max age %s: the window at least 1s, the age at least the window", s.Duplicates, s.MaxAge)
	case s.Replicas < 1 || s.Replicas > 5:
		return fmt.Errorf("replicas %d: between 1 and 5", s.Replicas)
	}
	return nil
}

// Ensure creates the stream, or updates its settings, and returns its name.
//
// It updates a stream only when its settings differ, and creates one that
// does not exist (an identical one created meanwhile by another relay is
// fine): relays started together on a new server then never send an update
// beside a create, which crashed nats-server 2.9.10 (a nil pointer in
// stream.updateWithAdvisory, found by the chaos suite in NATS mode).
func Ensure(ctx context.Context, js jetstream.JetStream, s Stream) (string, error) {
	s = s.withDefaults()
	if err := s.Validate(); err != nil {
		return "", err
	}
	want := jetstream.StreamConfig{
		Name:        s.Name,
		Description: "transactional outbox events, published by the relay (github.com/tedbank/outbox)",
		Subjects:    []string{s.SubjectPrefix + ">"},
		Retention:   jetstream.LimitsPolicy,
		MaxAge:      s.MaxAge,
		Duplicates:  s.Duplicates,
		Storage:     jetstream.FileStorage,
		Replicas:    s.Replicas,
		Discard:     jetstream.DiscardOld,
	}
	fail := func(err error) (string, error) {
		return "", fmt.Errorf("create or update JetStream stream %s (subjects %s>): %w", s.Name, s.SubjectPrefix, err)
	}
	for range 2 {
		st, err := js.Stream(ctx, s.Name)
		switch {
		case errors.Is(err, jetstream.ErrStreamNotFound):
			_, err = js.CreateStream(ctx, want)
			if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
				continue // another relay created it with other settings: look again
			}
			if err != nil {
				return fail(err)
			}
			return s.Name, nil
		case err != nil:
			return fail(err)
		}
		if have := st.CachedInfo().Config; sameSettings(have, want) {
			return s.Name, nil
		}
		if _, err := js.UpdateStream(ctx, want); err != nil {
			return fail(err)
		}
		return s.Name, nil
	}
	return fail(errors.New("created and changed by another relay meanwhile; try again"))
}

// sameSettings: have holds the settings Ensure sets, as want has them.
func sameSettings(have, want jetstream.StreamConfig) bool {
	return have.Description == want.Description && slices.Equal(have.Subjects, want.Subjects) &&
		have.Retention == want.Retention && have.MaxAge == want.MaxAge && have.Duplicates == want.Duplicates &&
		have.Storage == want.Storage && have.Replicas == want.Replicas && have.Discard == want.Discard
}

// Connect connects to the NATS server at url (nats://host:port; a
// comma-separated list for a cluster) as name, reconnecting forever after a
// loss, and returns the connection and its JetStream context. The first
// connection must succeed.
func Connect(url, name string) (*nats.Conn, jetstream.JetStream, error) {
	// A ping every 2s, two unanswered: a half-open connection (the server
	// gone silent, its packets swallowed) is dropped within about 6s even
	// when nothing else notices; publish and fetch timeouts reconnect at
	// once (Stale).
	nc, err := nats.Connect(url, nats.Name(name), nats.MaxReconnects(-1), nats.ReconnectWait(250*time.Millisecond),
		nats.Timeout(5*time.Second), nats.PingInterval(2*time.Second), nats.MaxPingsOutstanding(2), nats.ReconnectBufSize(-1))
	if err != nil {
		return nil, nil, fmt.Errorf("connect to NATS at %s: %w", url, err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, fmt.Errorf("JetStream: %w", err)
	}
	return nc, js, nil
}

// Down reports whether err means the NATS server or JetStream as a whole
// cannot take or give messages right now (unreachable, reconnecting, no
// stream listening, timed out, JetStream unavailable), as opposed to a
// problem of one message.
func Down(err error) bool {
	if err == nil {
		return false
	}
	for _, target := range []error{context.DeadlineExceeded, context.Canceled, nats.ErrConnectionClosed,
		nats.ErrConnectionReconnecting, nats.ErrConnectionDraining, nats.ErrDisconnected, nats.ErrTimeout,
		nats.ErrNoResponders, nats.ErrStaleConnection, nats.ErrReconnectBufExceeded,
		jetstream.ErrNoStreamResponse, jetstream.ErrStreamNotFound, jetstream.ErrJetStreamNotEnabled,
		jetstream.ErrJetStreamNotEnabledForAccount,
		// Too many asynchronous publishes waiting for their acknowledgement:
		// the server is slow or gone, not the message wrong.
		jetstream.ErrTooManyStalledMsgs} {
		if errors.Is(err, target) {
			return true
		}
	}
	var netErr net.Error
	if errors.As(err, &netErr) {
		return true
	}
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.Code >= 500
}

// Stale reports whether err says the connection went silent (a request
// timed out, a pull request's heartbeats stopped): the caller should
// reconnect (nats.Conn.ForceReconnect) rather than wait for the pings to
// find out.
func Stale(err error) bool {
	return errors.Is(err, nats.ErrTimeout) || errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, jetstream.ErrNoHeartbeat) || errors.Is(err, jetstream.ErrNoStreamResponse)
}
