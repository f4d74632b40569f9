package cli

import (
	"errors"
	"flag"
	"net"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/tedbank/outbox/internal/connect"
	"github.com/tedbank/outbox/internal/natsjs"
)

// The brokers a deployment can run on (--broker, env OUTBOX_BROKER).
const (
	brokerRedis = "redis"
	brokerNATS  = "nats"
)

// brokerChoice is --broker and --nats-url, which relay, fraud, ledger and
// status take.
type brokerChoice struct {
	name, natsURL string
}

func brokerFlags(e *env, fs *flag.FlagSet) *brokerChoice {
	b := &brokerChoice{}
	fs.StringVar(&b.name, "broker", envOr(e.getenv, "OUTBOX_BROKER", brokerRedis),
		"where events travel: redis (Redis Streams) or nats (NATS JetStream) (env OUTBOX_BROKER)")
	fs.StringVar(&b.natsURL, "nats-url", envOr(e.getenv, "NATS_URL", nats.DefaultURL),
		"NATS URL with --broker nats: nats://host:port, comma-separated for a cluster (env NATS_URL)")
	return b
}

// check reports a --broker that is neither.
func (b *brokerChoice) check() error {
	if b.name != brokerRedis && b.name != brokerNATS {
		return usagef("--broker %q (or OUTBOX_BROKER): want redis or nats", b.name)
	}
	return nil
}

func (b *brokerChoice) nats() bool { return b.name == brokerNATS }

// connect connects to NATS as name; the caller closes the connection. A
// server that does not answer is connect.ErrUnreachable.
func (b *brokerChoice) connect(name string) (*nats.Conn, jetstream.JetStream, error) {
	nc, js, err := natsjs.Connect(b.natsURL, name)
	var netErr net.Error
	if errors.Is(err, nats.ErrNoServers) || errors.Is(err, nats.ErrTimeout) || errors.As(err, &netErr) {
		err = connect.Unreachable(err) // not running yet, not resolvable yet, not answering
	}
	return nc, js, err
}

// natsStreamFlags defines the relay's JetStream stream settings.
func natsStreamFlags(fs *flag.FlagSet) (name *string, duplicates, maxAge *time.Duration) {
	name = fs.String("nats-stream", natsjs.DefaultStream, "with --broker nats: the JetStream stream holding <stream-prefix>> (created or updated at start)")
	duplicates = fs.Duration("nats-duplicates", natsjs.DefaultDuplicates, "with --broker nats: the stream's duplicate window (the server drops an event published again within it)")
	maxAge = fs.Duration("nats-max-age", natsjs.DefaultMaxAge, "with --broker nats: how long the stream keeps a message, read or not")
	return name, duplicates, maxAge
}
