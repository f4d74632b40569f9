package bench

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/relay/redisbroker"
	"github.com/tedbank/outbox/transfer"
)

// WritersConfig is the writers scenario's matrix.
type WritersConfig struct {
	Writers  []int         // concurrent writers of each case
	Modes    []string      // notify modes (outbox_notify_mode), each case
	Duration time.Duration // how long the writers commit in each case
	Poll     time.Duration // the relay's fallback poll (0: its default)
	// OffPoll is the relay's poll in mode off (0: Poll). Without wake-ups a
	// relay polling every few seconds does almost no work while the writers
	// run, and the comparison would be against a database with no relay
	// load; a short poll keeps it draining as it does in the other modes.
	OffPoll time.Duration
}

// Writers measures settle throughput: for every writer count and notify mode
// (writer counts outermost), in a fresh database switched to the mode with
// SELECT outbox_notify_mode(mode), one relay runs while the writers call
// transfer.Settle back to back for the duration. Each result is one case:
// events_per_s is transactions committed per second, the percentiles are
// commit latencies (the Settle call), backlog_at_end what the relay had not
// published when the writers stopped, polls_with_work the relay's fallback
// polls that found rows while they wrote, and ratio_to_off the case's rate over
// that of mode off at the same writer count (when off is measured). Before the
// next case the relay publishes everything the writers committed.
func Writers(ctx context.Context, e Env, cfg WritersConfig) ([]Result, error) {
	var out []Result
	for _, w := range cfg.Writers {
		for _, mode := range cfg.Modes {
			r, err := writersCase(ctx, e, w, mode, cfg)
			if err != nil {
				return nil, fmt.Errorf("%d writers, notify %s: %w", w, mode, err)
			}
			out = append(out, r)
		}
	}
	SetRatios(out)
	return out, nil
}

// notifyMode switches the space's outbox trigger with outbox_notify_mode;
// an empty mode leaves the migrations' default.
func (s *space) notifyMode(ctx context.Context, mode string) error {
	if mode == "" {
		return nil
	}
	if _, err := s.pool.Exec(ctx, "SELECT outbox_notify_mode($1::text)", mode); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42883" { // undefined_function
			return fmt.Errorf("this schema has no outbox_notify_mode(text); the notify modes need its migration: %w", err)
		}
		return fmt.Errorf("switch notify mode: %w", err)
	}
	return nil
}

// SetRatios sets ratio_to_off of every writers result whose writer count also
// has a result for mode off (after Repeat: the ratio of the medians).
func SetRatios(rs []Result) {
	off := map[any]float64{}
	for _, r := range rs {
		if r.Scenario == "writers" && r.Settings["mode"] == "off" {
			off[r.Settings["writers"]] = r.EventsPerS
		}
	}
	for i, r := range rs {
		if base, ok := off[r.Settings["writers"]]; ok && r.Scenario == "writers" && base > 0 {
			rs[i].RatioToOff = ptr(r.EventsPerS / base)
		}
	}
}

func writersCase(ctx context.Context, e Env, writers int, mode string, cfg WritersConfig) (Result, error) {
	s, err := e.open(ctx, "writers", int32(writers+4))
	if err != nil {
		return Result{}, err
	}
	defer s.close()
	if err := s.notifyMode(ctx, mode); err != nil {
		return Result{}, err
	}
	if err := s.warm(ctx, writers+2); err != nil {
		return Result{}, err
	}
	poll := cfg.Poll
	if mode == "off" && cfg.OffPoll > 0 {
		poll = cfg.OffPoll
	}
	rp, err := s.relayPool(ctx)
	if err != nil {
		return Result{}, err
	}
	r, err := redisRelay(rp, s.rdb, relay.Config{Name: "bench", StreamPrefix: s.prefix, PollInterval: poll, Logger: e.Log,
		Ownership: e.Ownership, BusyRows: e.BusyRows}, redisbroker.Config{})
	if err != nil {
		return Result{}, err
	}
	var relayWG sync.WaitGroup
	defer relayWG.Wait()
	rctx, stopRelay := context.WithCancel(ctx)
	defer stopRelay()
	relayWG.Go(func() { _ = r.Run(rctx) })
	for !r.Stats().ListenUp {
		if err := ctx.Err(); err != nil {
			return Result{}, err
		}
		time.Sleep(time.Millisecond)
	}

	var (
		mu      sync.Mutex
		lat     []time.Duration
		errs    int64
		lastErr error
		wg      sync.WaitGroup
	)
	start := time.Now()
	end := start.Add(cfg.Duration)
	for range writers {
		wg.Go(func() {
			var mine []time.Duration
			var bad int64
			var last error
			for time.Now().Before(end) && ctx.Err() == nil {
				from := rand.IntN(1000)
				t := transfer.Transfer{ID: uuid.New(), FromAccount: fmt.Sprintf("acct-%03d", from),
					ToAccount: fmt.Sprintf("acct-%03d", (from+1+rand.IntN(999))%1000), AmountCents: amount()}
				t0 := time.Now()
				if _, err := transfer.Settle(ctx, s.pool, t); err != nil {
					bad, last = bad+1, err
					continue
				}
				mine = append(mine, time.Since(t0))
			}
			mu.Lock()
			lat = append(lat, mine...)
			errs += bad
			if last != nil {
				lastErr = last
			}
			mu.Unlock()
		})
	}
	wg.Wait()
	took := time.Since(start)
	if err := ctx.Err(); err != nil {
		return Result{}, err
	}
	if len(lat) == 0 {
		return Result{}, fmt.Errorf("%w (last error: %v)", errNoEvents, lastErr)
	}
	left, err := s.backlog(ctx)
	if err != nil {
		return Result{}, err
	}
	st := r.Stats()
	polls := st.PollsWithWork
	// The relay consumes what was written before the next case starts.
	deadline := time.Now().Add(60*time.Second + 2*r.Config().PollInterval)
	for b := left; b > 0; {
		if time.Now().After(deadline) {
			return Result{}, fmt.Errorf("the relay left %d of %d events unpublished %s after the writers stopped", b, len(lat), time.Since(end).Round(time.Second))
		}
		time.Sleep(20 * time.Millisecond)
		if b, err = s.backlog(ctx); err != nil {
			return Result{}, err
		}
	}
	res := percentiles("writers", lat, took, map[string]any{"writers": writers, "mode": mode,
		"duration": cfg.Duration.String(), "relays": 1, "poll": r.Config().PollInterval.String(), "latency": "commit",
		"notifications": st.Notifications, "claims": st.Claims, "busy_rows": r.Config().BusyRows, "ownership": r.Ownership()})
	res.Errors = ptr(errs)
	res.BacklogAtEnd = ptr(left)
	res.PollsWithWork = ptr(polls)
	return res, nil
}
