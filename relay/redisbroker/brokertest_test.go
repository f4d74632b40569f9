package redisbroker_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/tcpproxy"
	"github.com/tedbank/outbox/relay/broker/brokertest"
	"github.com/tedbank/outbox/relay/redisbroker"
)

func TestMain(m *testing.M) { outboxtest.Main(m) }

// The broker passes the seam's kit on a real Redis, reached through a
// proxy that the outage check takes down.
func TestBrokerKit(t *testing.T) {
	brokertest.Run(t, func(t *testing.T) brokertest.Harness {
		r := outboxtest.NewRedis(t)
		px, err := tcpproxy.Start(r.Options().Addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = px.Close() })
		rdb := redis.NewClient(&redis.Options{Addr: px.Addr(), ClientName: "brokertest",
			DialTimeout: time.Second, ReadTimeout: 2 * time.Second, WriteTimeout: 2 * time.Second})
		t.Cleanup(func() { _ = rdb.Close() })
		b, err := redisbroker.New(rdb, redisbroker.Config{})
		if err != nil {
			t.Fatal(err)
		}
		return brokertest.Harness{
			Broker: b,
			Dest:   func(name string) string { return r.Prefix + name },
			Read: func(ctx context.Context, dest string) ([]brokertest.Entry, error) {
				xs, err := r.XRange(ctx, dest, "-", "+").Result()
				if err != nil {
					return nil, err
				}
				entries := make([]brokertest.Entry, len(xs))
				for i, x := range xs {
					fields := make(map[string]string, len(x.Values))
					for k, v := range x.Values {
						fields[k] = fmt.Sprint(v)
					}
					entries[i] = brokertest.Entry{ID: x.ID, Fields: fields}
				}
				return entries, nil
			},
			Down: px.Down,
			Up:   px.Up,
		}
	})
}
