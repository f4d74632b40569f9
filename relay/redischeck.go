package relay

import (
	"context"

	"github.com/redis/go-redis/v9"
)

// CheckRedisDurability returns warnings about Redis settings under which
// events the outbox already marked published can be lost: without an
// append-only file a restart loses the streams, and an eviction policy other
// than noeviction can evict streams or consumer-side dedupe markers under
// memory pressure. It returns nothing when CONFIG is not allowed (managed
// Redis services often forbid it).
func CheckRedisDurability(ctx context.Context, rdb redis.Cmdable) []string {
	cfg, err := rdb.ConfigGet(ctx, "appendonly").Result()
	if err != nil {
		return nil
	}
	var warnings []string
	if cfg["appendonly"] == "no" {
		warnings = append(warnings, "Redis runs without appendonly: a Redis restart loses stream entries the outbox already marked published (set appendonly yes)")
	}
	if policy, err := rdb.ConfigGet(ctx, "maxmemory-policy").Result(); err == nil {
		if p := policy["maxmemory-policy"]; p != "" && p != "noeviction" {
			warnings = append(warnings, "Redis maxmemory-policy is "+p+": streams or dedupe markers can be evicted (set noeviction, so writes fail loudly instead)")
		}
	}
	return warnings
}
