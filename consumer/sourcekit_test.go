package consumer

import (
	"context"
	"log/slog"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer/natssource"
	"github.com/tedbank/outbox/consumer/source"
	"github.com/tedbank/outbox/consumer/source/sourcetest"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/relay/entry"
)

// Redis Streams' source passes the seam's kit, as JetStream's does
// (TestSourceKitJetStream).
func TestSourceKit(t *testing.T) {
	t.Parallel()
	sourcetest.Run(t, func(t *testing.T) sourcetest.Harness {
		rdb := outboxtest.NewRedis(t)
		return sourcetest.Harness{
			Source: func(consumer string) source.Source {
				cfg := testConfig(rdb, consumer).withDefaults()
				return newStreams(rdb.Client, cfg, slog.New(slog.DiscardHandler))
			},
			Subject: func(name string) string { return rdb.Prefix + name },
			Publish: func(ctx context.Context, subject string, fields map[string]string) error {
				values := make(map[string]any, len(fields))
				for k, v := range fields {
					values[k] = v
				}
				return rdb.XAdd(ctx, &redis.XAddArgs{Stream: subject, Values: values}).Err()
			},
		}
	})
}

// JetStream's source (consumer/natssource) passes the seam's kit: the
// relay's way to publish is natsbroker's, the entry's fields as headers and
// the payload as the body.
func TestSourceKitJetStream(t *testing.T) {
	t.Parallel()
	sourcetest.Run(t, func(t *testing.T) sourcetest.Harness {
		e := newJSEnv(t)
		prefix := strings.TrimSuffix(e.cfg.Stream, "thing")
		return sourcetest.Harness{
			Source:  func(string) source.Source { return natssource.New(e.js) },
			Subject: func(name string) string { return prefix + name },
			Publish: func(ctx context.Context, subject string, fields map[string]string) error {
				h := nats.Header{}
				for k, v := range fields {
					if k != entry.Payload {
						h.Set(k, v)
					}
				}
				_, err := e.js.PublishMsg(ctx, &nats.Msg{Subject: subject, Data: []byte(fields[entry.Payload]), Header: h})
				return err
			},
		}
	})
}

// A redelivered batch's delivery counts are looked up over its range of
// ids, where other entries pending with the consumer may lie: each entry
// of the batch gets its own count (an invalid entry on its last delivery
// is dead-lettered then, not a delivery later).
func TestDeliveryCountsOfEntriesWithOthersPendingBetween(t *testing.T) {
	t.Parallel()
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	cfg := testConfig(rdb, "c").withDefaults()
	s := newStreams(rdb.Client, cfg, slog.New(slog.DiscardHandler))
	if err := s.CreateGroup(ctx, cfg.Group, cfg.Stream); err != nil {
		t.Fatal(err)
	}
	for i := range 4 {
		if err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: cfg.Stream, Values: []any{"n", i}}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	res, err := rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: cfg.Group, Consumer: "c", Streams: []string{cfg.Stream, ">"}, Block: -1}).Result()
	if err != nil || len(res) != 1 || len(res[0].Messages) != 4 {
		t.Fatalf("read %v, %v", res, err)
	}
	xs := res[0].Messages
	r := s.reader(source.Partition{Group: cfg.Group, Subject: cfg.Stream}, newGate())
	for _, m := range r.messages(ctx, []redis.XMessage{xs[0], xs[3]}, true) {
		if m.Deliveries() != 1 {
			t.Errorf("entry %s: %d deliveries, want 1", m.ID(), m.Deliveries())
		}
	}
}
