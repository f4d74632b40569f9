package relay

import (
	"context"
	_ "embed"
	"fmt"
	"log/slog"
	"time"

	"github.com/redis/go-redis/v9"
)

// Trimmer is what trimming needs from Redis; *redis.Client satisfies it.
type Trimmer interface {
	redis.Scripter
}

//go:embed trim.lua
var trimSrc string

var trimScript = redis.NewScript(trimSrc)

// maxTrimPerPass bounds the entries one trim call removes (and reads inside
// Redis, which is blocked meanwhile); a larger excess goes over several passes.
const maxTrimPerPass = 10_000

// stepTrimStream caps stream to the configured MAXLEN and retention, but never
// removes an entry that some consumer group has not yet read, or read and
// not yet acknowledged: a lagging consumer delays trimming instead of losing
// events. A stream without any consumer group is not trimmed (its consumers
// may not have created their group yet). The checks and the trim run in one
// Lua script, so a group created or rewound meanwhile is respected. It
// returns how many entries it removed.
func (r *Relay) stepTrimStream(ctx context.Context, rdb Trimmer, stream string) (int64, error) {
	if r.cfg.StreamMaxLen <= 0 && r.cfg.StreamRetention <= 0 {
		return 0, nil
	}
	retention := ""
	if r.cfg.StreamRetention > 0 {
		retention = fmt.Sprintf("%d-0", time.Now().Add(-r.cfg.StreamRetention).UnixMilli())
	}
	n, err := trimScript.Run(ctx, rdb, []string{stream}, r.cfg.StreamMaxLen, retention, maxTrimPerPass).Int64()
	if err != nil {
		return 0, fmt.Errorf("trim %s: %w", stream, err)
	}
	return n, nil
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
			n, err := r.stepTrimStream(ctx, rdb, stream)
			switch {
			case err != nil && ctx.Err() == nil:
				r.log.Warn("trimming failed", slog.String("stream", stream), slog.Any("error", err))
			case n > 0:
				r.log.Debug("trimmed stream", slog.String("stream", stream), slog.Int64("entries", n))
				r.cfg.Metrics.trimmedEntries(n)
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
