package relay

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// Trimmer is what trimming needs from Redis; *redis.Client satisfies it.
type Trimmer interface {
	XLen(ctx context.Context, stream string) *redis.IntCmd
	XRangeN(ctx context.Context, stream, start, stop string, count int64) *redis.XMessageSliceCmd
	XInfoGroups(ctx context.Context, stream string) *redis.XInfoGroupsCmd
	XPending(ctx context.Context, stream, group string) *redis.XPendingCmd
	XTrimMinID(ctx context.Context, key string, minID string) *redis.IntCmd
}

// maxTrimScan bounds how many entries one trim pass reads to find the
// MAXLEN boundary; a larger excess is trimmed over several passes.
const maxTrimScan = 100_000

// TrimStream caps stream to the configured MAXLEN and retention, but never
// removes an entry that some consumer group has not yet read, or read and
// not yet acknowledged: a lagging consumer delays trimming instead of losing
// events. It returns how many entries it removed.
func (r *Relay) TrimStream(ctx context.Context, rdb Trimmer, stream string) (int64, error) {
	if r.cfg.StreamMaxLen <= 0 && r.cfg.StreamRetention <= 0 {
		return 0, nil
	}
	var target string // entries with a lower id may go
	if r.cfg.StreamRetention > 0 {
		target = fmt.Sprintf("%d-0", time.Now().Add(-r.cfg.StreamRetention).UnixMilli())
	}
	if r.cfg.StreamMaxLen > 0 {
		n, err := rdb.XLen(ctx, stream).Result()
		if err != nil {
			return 0, fmt.Errorf("xlen %s: %w", stream, err)
		}
		if excess := n - r.cfg.StreamMaxLen; excess > 0 {
			// The id of the first entry to keep.
			msgs, err := rdb.XRangeN(ctx, stream, "-", "+", min(excess, maxTrimScan)+1).Result()
			if err != nil {
				return 0, fmt.Errorf("xrange %s: %w", stream, err)
			}
			if len(msgs) > 0 {
				target = maxID(target, msgs[len(msgs)-1].ID)
			}
		}
	}
	if target == "" {
		return 0, nil
	}

	groups, err := rdb.XInfoGroups(ctx, stream).Result()
	if err != nil {
		if strings.Contains(err.Error(), "no such key") {
			return 0, nil
		}
		return 0, fmt.Errorf("xinfo groups %s: %w", stream, err)
	}
	for _, g := range groups {
		// Entries after last-delivered-id are unread; pending ones are
		// unacknowledged. Keep both.
		safe := g.LastDeliveredID
		if g.Pending > 0 {
			p, err := rdb.XPending(ctx, stream, g.Name).Result()
			if err != nil {
				return 0, fmt.Errorf("xpending %s %s: %w", stream, g.Name, err)
			}
			safe = minID(safe, p.Lower)
		}
		target = minID(target, safe)
	}
	removed, err := rdb.XTrimMinID(ctx, stream, target).Result()
	if err != nil {
		return 0, fmt.Errorf("xtrim %s minid %s: %w", stream, target, err)
	}
	return removed, nil
}

// trimLoop trims every stream this relay published to, every TrimInterval.
func (r *Relay) trimLoop(ctx context.Context, rdb Trimmer) {
	t := time.NewTicker(r.cfg.TrimInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for _, stream := range r.streamsSeen() {
			n, err := r.TrimStream(ctx, rdb, stream)
			switch {
			case err != nil && ctx.Err() == nil:
				r.log.Warn("trimming failed", slog.String("stream", stream), slog.Any("error", err))
			case n > 0:
				r.log.Debug("trimmed stream", slog.String("stream", stream), slog.Int64("entries", n))
				if m := r.cfg.Metrics; m != nil {
					m.trimmed.Add(float64(n))
				}
			}
		}
	}
}

func (r *Relay) noteStream(stream string) {
	r.streamsMu.Lock()
	defer r.streamsMu.Unlock()
	if r.streams == nil {
		r.streams = map[string]bool{}
	}
	r.streams[stream] = true
}

func (r *Relay) streamsSeen() []string {
	r.streamsMu.Lock()
	defer r.streamsMu.Unlock()
	out := make([]string, 0, len(r.streams))
	for s := range r.streams {
		out = append(out, s)
	}
	return out
}

// compareIDs orders stream ids "ms-seq"; "" sorts after everything (no bound).
func compareIDs(a, b string) int {
	switch {
	case a == b:
		return 0
	case a == "":
		return 1
	case b == "":
		return -1
	}
	am, as := splitID(a)
	bm, bs := splitID(b)
	if am != bm {
		if am < bm {
			return -1
		}
		return 1
	}
	if as < bs {
		return -1
	}
	if as > bs {
		return 1
	}
	return 0
}

func minID(a, b string) string {
	if compareIDs(a, b) <= 0 {
		return a
	}
	return b
}

func maxID(a, b string) string {
	if a == "" {
		return b
	}
	if compareIDs(a, b) >= 0 {
		return a
	}
	return b
}

func splitID(id string) (ms, seq uint64) {
	m, s, _ := strings.Cut(id, "-")
	ms, _ = strconv.ParseUint(m, 10, 64)
	seq, _ = strconv.ParseUint(s, 10, 64)
	return ms, seq
}
