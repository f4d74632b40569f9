package redisbroker

import (
	"context"
	_ "embed"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

//go:embed trim.lua
var trimSrc string

var trimScript = redis.NewScript(trimSrc)

// maxTrimPerPass bounds the entries one trim call removes (and reads inside
// Redis, which is blocked meanwhile); a larger excess goes over several passes.
const maxTrimPerPass = 10_000

// trims reports whether the broker trims its streams at all.
func (b *Broker) trims() bool { return b.cfg.StreamMaxLen > 0 || b.cfg.StreamRetention > 0 }

// TrimStream caps stream to Config.StreamMaxLen and StreamRetention once, but
// never removes an entry that some consumer group has not yet read, or read
// and not yet acknowledged: a lagging consumer delays trimming instead of
// losing events. A stream without any consumer group is not trimmed (its
// consumers may not have created their group yet). The checks and the trim
// run in one Lua script, so a group created or rewound meanwhile is
// respected. It returns how many entries it removed. Maintain calls it for
// every stream the broker published to.
func (b *Broker) TrimStream(ctx context.Context, stream string) (int64, error) {
	if !b.trims() {
		return 0, nil
	}
	s, ok := b.rdb.(redis.Scripter)
	if !ok {
		return 0, fmt.Errorf("trim %s: the Redis client cannot run scripts", stream)
	}
	retention := ""
	if b.cfg.StreamRetention > 0 {
		retention = fmt.Sprintf("%d-0", time.Now().Add(-b.cfg.StreamRetention).UnixMilli())
	}
	n, err := trimScript.Run(ctx, s, []string{stream}, b.cfg.StreamMaxLen, retention, maxTrimPerPass).Int64()
	if err != nil {
		return 0, fmt.Errorf("trim %s: %w", stream, err)
	}
	return n, nil
}

// Maintain trims every stream the broker published to, every
// Config.TrimInterval, until ctx ends; it returns at once when the broker
// does not trim. The relay runs it beside its drainer (broker.Maintainer).
func (b *Broker) Maintain(ctx context.Context) {
	if !b.trims() {
		return
	}
	t := time.NewTicker(b.cfg.TrimInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for _, stream := range b.streams.list() {
			n, err := b.TrimStream(ctx, stream)
			switch {
			case err != nil && ctx.Err() == nil:
				b.cfg.Logger.Warn("trimming failed", slog.String("stream", stream), slog.Any("error", err))
			case n > 0:
				b.cfg.Logger.Debug("trimmed stream", slog.String("stream", stream), slog.Int64("entries", n))
				b.cfg.Metrics.trimmedEntries(n)
			}
		}
	}
}

// streamSet is the streams a broker published to, for trimming.
type streamSet struct {
	mu   sync.Mutex
	seen map[string]bool
}

func (s *streamSet) add(streams []string, errs []error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.seen == nil {
		s.seen = map[string]bool{}
	}
	for i, stream := range streams {
		if errs[i] == nil {
			s.seen[stream] = true
		}
	}
}

func (s *streamSet) list() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]string, 0, len(s.seen))
	for stream := range s.seen {
		out = append(out, stream)
	}
	return out
}
