package redisbroker

import (
	"context"
	"log/slog"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/redischeck"
)

// ErrEvictingRedis is wrapped by Check's error (and so by relay.Run's) when
// Redis evicts keys under memory pressure (Config.AllowEvictingRedis).
var ErrEvictingRedis = redischeck.ErrEvicting

// Check refuses a Redis that evicts keys (ErrEvictingRedis) unless
// Config.AllowEvictingRedis says otherwise, and logs the other settings
// under which published events can be lost (CheckDurability). A Redis it
// cannot read INFO from is not refused (the first publish says why, if it
// is down). The relay calls it when Run starts (broker.Checker).
func (b *Broker) Check(ctx context.Context) error {
	nodes, err := redischeck.Inspect(ctx, b.rdb)
	if err != nil { // refused on what it could read, below
		b.cfg.Logger.Warn("could not read the Redis eviction policy of every node", slog.Any("error", err))
	}
	for _, w := range durabilityWarnings(nodes) {
		if !strings.Contains(w, "maxmemory-policy") { // refused, or allowed, below
			b.cfg.Logger.Warn(w)
		}
	}
	if err := redischeck.Refuse(nodes, "Config.AllowEvictingRedis (outbox relay: --allow-evicting-redis)"); err != nil {
		if !b.cfg.AllowEvictingRedis {
			return err
		}
		b.cfg.Logger.Warn("starting on an evicting Redis, as allowed", slog.Any("warning", err))
	}
	return nil
}

// CheckDurability returns warnings about Redis settings under which events
// the outbox already marked published can be lost: without an append-only
// file a restart loses the streams, and an eviction policy other than
// noeviction can evict streams or consumer-side dedupe markers under memory
// pressure. It reads INFO (allowed where managed Redis services forbid
// CONFIG), on every node of a Redis Cluster, and returns nothing when Redis
// does not answer.
func CheckDurability(ctx context.Context, rdb redis.Cmdable) []string {
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
