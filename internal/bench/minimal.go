package bench

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/partition"
)

// The minimal consumer is the baseline every consume figure is compared
// with, measured in the same run on the same servers: per partition stream,
// one loop that reads `batch` entries with XREADGROUP, runs one pipelined
// script per entry (SET NX of the event's marker and, when it was new, an
// HINCRBY), and XACKs them. No decoding of the payload, no per-key order, no
// fencing, retries or dead letters: what any Redis Streams consumer that
// applies each event once must pay at least.
var minimalEffect = redis.NewScript(`
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', 3600) then
  return redis.call('HINCRBY', KEYS[2], 'applied', 1)
end
return 0`)

// minimalConsume runs the minimal consumer over n entries already in the
// partitions of stream (each read by a group of its own) and returns how
// long it took them to be applied and acknowledged, and how many distinct
// events it applied.
func minimalConsume(ctx context.Context, rdb redis.UniversalClient, stream, prefix string, parts, n, batch int) (time.Duration, int64, error) {
	const group = "minimal"
	streams := partition.Streams(stream, parts)
	for _, s := range streams {
		if err := rdb.XGroupCreateMkStream(ctx, s, group, "0").Err(); err != nil && !redis.HasErrorPrefix(err, "BUSYGROUP") {
			return 0, 0, err
		}
	}
	if err := minimalEffect.Load(ctx, rdb).Err(); err != nil {
		return 0, 0, err
	}
	stats := prefix + "minimal:stats"
	var (
		mu   sync.Mutex
		done int
		errs []error
		wg   sync.WaitGroup
	)
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	start := time.Now()
	for _, s := range streams {
		wg.Go(func() {
			for cctx.Err() == nil {
				res, err := rdb.XReadGroup(cctx, &redis.XReadGroupArgs{Group: group, Consumer: "m", Streams: []string{s, ">"},
					Count: int64(batch), Block: 100 * time.Millisecond}).Result()
				if err == redis.Nil {
					continue
				}
				if err != nil {
					if cctx.Err() == nil {
						mu.Lock()
						errs = append(errs, err)
						mu.Unlock()
						cancel()
					}
					return
				}
				msgs := res[0].Messages
				ids := make([]string, len(msgs))
				_, err = rdb.Pipelined(cctx, func(p redis.Pipeliner) error {
					for i, m := range msgs {
						ids[i] = m.ID
						minimalEffect.EvalSha(cctx, p, []string{prefix + "minimal:seen:" + fmt.Sprint(m.Values["event_id"]), stats})
					}
					p.XAck(cctx, s, group, ids...)
					return nil
				})
				if err != nil && cctx.Err() == nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
					cancel()
					return
				}
				mu.Lock()
				done += len(msgs)
				if done >= n {
					cancel()
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	took := time.Since(start)
	if len(errs) > 0 {
		return 0, 0, fmt.Errorf("minimal consumer: %w", errs[0])
	}
	if done < n {
		return 0, 0, fmt.Errorf("minimal consumer: %d of %d entries (%w)", done, n, ctx.Err())
	}
	applied, err := rdb.HGet(ctx, stats, "applied").Int64()
	return took, applied, err
}
