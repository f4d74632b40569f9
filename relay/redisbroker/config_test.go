package redisbroker

import (
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/relay/broker"
)

// Streams are trimmed by default, behind what every group acknowledged;
// an explicit cap replaces the default, and a negative retention keeps all.
func TestConfigTrimsStreamsByDefault(t *testing.T) {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialled
	defer rdb.Close()
	for _, tc := range []struct {
		in        Config
		maxLen    int64
		retention time.Duration
		trims     bool
	}{
		{Config{}, 0, DefaultStreamRetention, true},
		{Config{StreamMaxLen: 1000}, 1000, 0, true},
		{Config{StreamRetention: -1}, 0, -1, false},
	} {
		b, err := New(rdb, tc.in)
		if err != nil {
			t.Fatalf("%+v: %v", tc.in, err)
		}
		if b.cfg.StreamMaxLen != tc.maxLen || b.cfg.StreamRetention != tc.retention || b.trims() != tc.trims {
			t.Errorf("%+v: max len %d, retention %s, trims %v; want %d, %s, %v", tc.in, b.cfg.StreamMaxLen,
				b.cfg.StreamRetention, b.trims(), tc.maxLen, tc.retention, tc.trims)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer rdb.Close()
	for name, c := range map[string]Config{
		"negative replicas":          {MinReplicas: -1},
		"negative max len":           {StreamMaxLen: -1},
		"negative trim interval":     {TrimInterval: -time.Second},
		"source without cloudevents": {CloudEvents: broker.CloudEvents{Source: "/bank/ted"}},
		"source with a space":        {CloudEvents: broker.CloudEvents{Enabled: true, Source: "/bank ted"}},
	} {
		if _, err := New(rdb, c); err == nil {
			t.Errorf("%s: New(%+v) accepted it", name, c)
		}
	}
	if _, err := New(nil, Config{}); err == nil {
		t.Error("New accepted no client")
	}
}
