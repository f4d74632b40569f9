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
