package consumer_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/relay/entry"
)

// An effect of your own in Redis, exactly once and in each key's order:
// you write the Lua of one message's effect and the keys and arguments it
// takes; NewRedisEffect wraps it with the partition's fence, the event's
// once-marker and the hold of a key behind its failed message. Here
// order.placed events, published by a relay to outbox.event.order, add to
// a customer's total.
func ExampleNewRedisEffect() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	opt, err := redis.ParseURL(os.Getenv("REDIS_URL"))
	if err != nil {
		log.Fatal(err)
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()

	effect, err := consumer.NewRedisEffect(rdb, consumer.RedisEffectConfig{
		// Checks first, then writes: Redis does not roll a script back.
		Lua: `
local cents = tonumber(ARGV[1])
if not cents or cents <= 0 then return redis.error_reply('INVALID amount ' .. ARGV[1]) end
redis.call('INCRBY', KEYS[1], cents)
return 'added'`,
		// KEYS[1] is the customer's total, named under the partition's
		// prefix by the effect (the consumer's KeyPrefix here).
		Args: func(m consumer.Message) ([]string, []any, error) {
			var order struct {
				Customer   string `json:"customer"`
				TotalCents int64  `json:"total_cents"`
			}
			if err := json.Unmarshal(m.Payload, &order); err != nil || order.Customer == "" {
				return nil, nil, consumer.Invalid("order.placed payload %s: %v", m.Payload, err)
			}
			return []string{"total:" + order.Customer}, []any{order.TotalCents}, nil
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	stream := "example.consumer.outbox.event.order"
	c, err := consumer.New(rdb, effect, consumer.Config{
		Name:      "totals", // metrics outbox_totals_*, group "totals"
		Stream:    stream,
		Consumer:  "totals-1", // stable across restarts, unique per process
		KeyPrefix: "example.consumer.totals:",
	})
	if err != nil {
		log.Fatal(err)
	}
	go func() { _ = c.Run(ctx) }()

	// One event, delivered twice (as after a relay crash between its XADD
	// and its mark), in the relay's wire format (relay/entry).
	eventID := uuid.NewString()
	for range 2 {
		rdb.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: []any{
			entry.EventID, eventID, entry.EventType, "order.placed", entry.AggregateType, "order",
			entry.AggregateID, "o-1", entry.PartitionKey, "ana", entry.Payload, `{"customer": "ana", "total_cents": 990}`}})
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if st := c.Stats(); st.Processed == 1 && st.Duplicates == 1 {
			break
		}
		if time.Now().After(deadline) {
			log.Fatalf("the event was not applied once within 10s: %+v", c.Stats())
		}
	}
	total, err := rdb.Get(ctx, "example.consumer.totals:total:ana").Result()
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("ana: %s cents (the duplicate delivery was skipped)\n", total)
	// Output:
	// ana: 990 cents (the duplicate delivery was skipped)
}
