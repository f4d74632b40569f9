package fraud

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"
)

// Dedupe across a change of the number of partitions. An event's marker
// lives under its partition's prefix (fraud:{p0.1}:seen:<id>), so it
// depends on P: an event applied under P = 1 and published again after the
// switch to P = 4 (a relay killed between its XADD and its mark, the row
// reaped and published under the new layout) would find no marker under
// the new prefix and be applied twice. So the consumers record in
// <prefix>layouts (a hash: P -> when a consumer last ran with it, Unix ms)
// the layouts they run, and, for as long as the markers of an earlier
// layout may live (DedupeTTL after it was last used), look each event's
// marker up under that layout's prefix too before applying it: one more
// round trip per batch, only in the dedupe TTL after a change of P. The
// look-up is not atomic with the effect, and need not be: the earlier
// layout's markers are written only by consumers of that layout, which the
// documented procedure stops before the new ones start.

// layoutsRefresh is how often a consumer says its layout is in use and reads
// the others.
const layoutsRefresh = time.Minute

// layouts is what a consumer knows of the group's earlier layouts.
type layouts struct {
	mu      sync.Mutex
	earlier []int     // other numbers of partitions whose markers may still live
	read    time.Time // when earlier was read (zero: never)
}

// earlierLayouts returns the numbers of partitions, other than this
// consumer's, that consumers ran with less than DedupeTTL ago, refreshing
// them (and saying this consumer's is in use) every layoutsRefresh.
func (e *effects) earlierLayouts(ctx context.Context) ([]int, error) {
	e.layouts.mu.Lock()
	defer e.layouts.mu.Unlock()
	if !e.layouts.read.IsZero() && time.Since(e.layouts.read) < layoutsRefresh {
		return e.layouts.earlier, nil
	}
	key := Keys{Prefix: e.cfg.KeyPrefix}.Layouts()
	now := time.Now()
	var all *redis.MapStringStringCmd
	_, err := e.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		p.HSet(ctx, key, strconv.Itoa(e.cfg.Partitions), now.UnixMilli())
		p.PExpire(ctx, key, 2*e.cfg.DedupeTTL)
		all = p.HGetAll(ctx, key)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read the group's layouts (%s): %w", key, err)
	}
	var earlier []int
	for ps, at := range all.Val() {
		n, err1 := strconv.Atoi(ps)
		ms, err2 := strconv.ParseInt(at, 10, 64)
		if err1 != nil || err2 != nil || n == e.cfg.Partitions || n < 1 {
			continue
		}
		if now.Sub(time.UnixMilli(ms)) < e.cfg.DedupeTTL {
			earlier = append(earlier, n)
		}
	}
	e.layouts.earlier, e.layouts.read = earlier, now
	return earlier, nil
}

// appliedEarlier reports, for each event of evs (zero ids: none), whether
// its marker exists under one of the earlier layouts.
func (e *effects) appliedEarlier(ctx context.Context, evs []Event) ([]bool, error) {
	earlier, err := e.earlierLayouts(ctx)
	if err != nil || len(earlier) == 0 {
		return nil, err
	}
	cmds := make([][]*redis.IntCmd, len(evs))
	_, err = e.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, ev := range evs {
			if ev.EventID == uuid.Nil {
				continue
			}
			for _, n := range earlier {
				k := Keys{Prefix: e.cfg.KeyPrefix, Partitions: n}.Sender(ev.FromAccount)
				cmds[i] = append(cmds[i], p.Exists(ctx, k.Seen(ev.EventID.String())))
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("look the events' markers up under the earlier layouts %v: %w", earlier, err)
	}
	seen := make([]bool, len(evs))
	for i, cs := range cmds {
		for _, c := range cs {
			seen[i] = seen[i] || c.Val() > 0
		}
	}
	return seen, nil
}
