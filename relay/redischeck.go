package relay

import (
	"context"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/redischeck"
)

// CheckRedisDurability returns warnings about Redis settings under which
// events the outbox already marked published can be lost: without an
// append-only file a restart loses the streams, and an eviction policy other
// than noeviction can evict streams or consumer-side dedupe markers under
// memory pressure. It reads INFO (allowed where managed Redis services
// forbid CONFIG), on every node of a Redis Cluster, and returns nothing when
// Redis does not answer. Run refuses an evicting Redis by itself
// (ErrEvictingRedis) and logs the other warnings.
func CheckRedisDurability(ctx context.Context, rdb redis.Cmdable) []string {
	nodes, _ := redischeck.Inspect(ctx, rdb)
	return durabilityWarnings(nodes)
}

func durabilityWarnings(nodes []redischeck.Node) []string {
	var warnings []string
	if addrs := redischeck.NoAOF(nodes); len(addrs) > 0 {
		warnings = append(warnings, "Redis runs without appendonly ("+strings.Join(addrs, ", ")+
			"): a Redis restart loses stream entries the outbox already marked published (set appendonly yes; "+
			"outbox reconcile finds what was lost)")
	}
	for _, n := range nodes {
		if n.Evicting() {
			warnings = append(warnings, "Redis maxmemory-policy is "+n.Policy+" ("+n.Addr+
				"): streams or dedupe markers can be evicted (set noeviction, so writes fail loudly instead)")
		}
	}
	return warnings
}
