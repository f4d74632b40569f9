package relay

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/tedbank/outbox/consumer"
)

func TestConfigDefaults(t *testing.T) {
	t.Parallel()
	c := Config{}.withDefaults()
	if c.BatchSize != DefaultBatchSize || c.Lease != DefaultLease || c.PollInterval != DefaultPollInterval ||
		c.MaxAttempts != DefaultMaxAttempts || c.ReapInterval != DefaultLease/2 || c.PublishTimeout != DefaultPublishTimeout ||
		c.Channel != DefaultChannel || c.Name == "" || c.BusyRows != DefaultBusyRows || c.Ownership != OwnRows {
		t.Fatalf("defaults: %+v", c)
	}
	if got := c.StreamKey("transfer"); got != "outbox.event.transfer" {
		t.Fatalf("stream key %q, want outbox.event.transfer", got)
	}
	if got := (Config{Stream: "all"}).StreamKey("transfer"); got != "all" {
		t.Fatalf("fixed stream key %q", got)
	}
	if err := (Config{}).Validate(); err != nil {
		t.Fatalf("zero config invalid: %v", err)
	}
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	for name, c := range map[string]Config{
		"negative batch":            {BatchSize: -1},
		"huge batch":                {BatchSize: MaxBatchSize + 1},
		"negative lease":            {Lease: -time.Second},
		"publish longer than lease": {Lease: time.Second, PublishTimeout: 2 * time.Second},
		"negative poll":             {PollInterval: -1},
		"negative busy rows":        {BusyRows: -1},
		"zero attempts":             {MaxAttempts: -3},
		"backoff inverted":          {BackoffBase: time.Minute, BackoffMax: time.Second},
		"bad channel":               {Channel: "Outbox; DROP TABLE x"},
		"bad stream":                {Stream: "a b"},
		"bad prefix":                {StreamPrefix: "x\n"},
	} {
		if err := c.Validate(); !errors.Is(err, ErrConfig) {
			t.Errorf("%s: Validate(%+v) = %v, want an ErrConfig", name, c, err)
		}
	}
}

func TestPipelineDown(t *testing.T) {
	e := errors.New("ERR max number of clients reached")
	w := errors.New("WRONGTYPE")
	cases := []struct {
		errs    []error
		streams []string
		want    bool
	}{
		{[]error{e, e}, []string{"a", "b"}, true},
		{[]error{w, w}, []string{"a", "a"}, false}, // one stream's problem
		{[]error{e, nil}, []string{"a", "b"}, false},
		{[]error{e}, []string{"a"}, false},
	}
	for _, c := range cases {
		if got := pipelineDown(c.errs, c.streams); got != c.want {
			t.Errorf("pipelineDown(%v, %v) = %v, want %v", c.errs, c.streams, got, c.want)
		}
	}
	if !strings.Contains(fmt.Sprint(errBrokerDown), "broker") {
		t.Fatal("errBrokerDown text")
	}
}

// A consumer's default dedupe window for the relays
// (consumer.DefaultRelayRedelivery) covers the relay's default redelivery
// window: every attempt of an event, each of which may have reached the
// broker.
func TestDefaultRedeliveryWindowFitsTheConsumers(t *testing.T) {
	w := Config{}.RedeliveryWindow()
	if w <= 0 || w > consumer.DefaultRelayRedelivery {
		t.Fatalf("relay redelivery window %s: must be positive and within consumer.DefaultRelayRedelivery %s", w, consumer.DefaultRelayRedelivery)
	}
	if got := (Config{MaxAttempts: 20}).RedeliveryWindow(); got != 2*w {
		t.Fatalf("with twice the attempts the window is %s, want %s", got, 2*w)
	}
}
