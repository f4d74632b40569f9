package bench

import (
	"context"
	"fmt"
	"strings"
	"time"
)

// Latency settles n TEDs at rate per second on an open-loop schedule, with one
// relay and one anti-fraud consumer, and measures, from the moment each
// Settle returned, commit → stream entry (seen by a separate XREAD reader)
// and commit → verdict. It returns both results; their events_per_s is the
// rate achieved (events over the writing phase). mode, when not empty, is
// the notify mode to switch to first (outbox_notify_mode). With baseline
// (Redis Streams only), the minimal relay (minimalrelay.go) then runs the
// same schedule in a space of its own, notify mode always, with the same
// reader and the same anti-fraud consumer (its work competes for the
// cores): a third result, latency_minimal_commit_to_stream, and the
// first's ratio_p50_to_baseline and ratio_p99_to_baseline, when both runs'
// writers reached the rate (latencyRatios); ratio_withheld says why not.
func Latency(ctx context.Context, e Env, rate float64, n int, mode string, baseline bool, h Horizon) ([]Result, error) {
	out, err := latency(ctx, e, rate, n, mode, h)
	if err != nil || !baseline || e.JS != nil {
		return out, err
	}
	base, err := latencyMinimal(ctx, e, rate, n)
	if err != nil {
		return nil, err
	}
	latencyRatios(&out[0], base, rate)
	return append(out, base), nil
}

// warmUp is how long a latency run settles TEDs at its rate before the
// timed phase. Each case runs in a fresh database, and there the first
// second or two are slow for any relay: a trace of the events over 20 ms at
// 200/s (docs/log.md) found every one of them, for this project's relay and
// the minimal one alike, in the first 2 s of a 10 s run (commit → XADD up
// to 180 ms), which made the p99 of a 2,000-event run, and its ratio, the
// size of that start-up (0.28× to 12.5× between runs of one build).
const warmUp = 2 * time.Second

// slowWarmUp counts the warm-up's events over 1 s (warm_up_over_1s).
type slowWarmUp struct{ toStream, toVerdict int64 }

// warmUp settles warmUp's worth of TEDs at rate on the open-loop schedule,
// waits for them, and forgets them but for those over 1 s.
func (f *flow) warmUp(ctx context.Context, rate float64) (slowWarmUp, error) {
	if _, err := openLoop(ctx, rate, max(1, int(rate*warmUp.Seconds())), f.settle); err != nil {
		return slowWarmUp{}, err
	}
	if err := f.wait(30 * time.Second); err != nil {
		return slowWarmUp{}, fmt.Errorf("warm-up: %w", err)
	}
	toStream, toVerdict := f.latencies()
	slow := slowWarmUp{toStream: *overOneSecond(toStream), toVerdict: *overOneSecond(toVerdict)}
	f.mu.Lock()
	clear(f.committed)
	clear(f.inStream)
	clear(f.judged)
	f.mu.Unlock()
	return slow, nil
}

// reachedRate is the share of the offered rate that a latency run's writers
// must reach for its percentiles to be compared with another run's.
const reachedRate = 0.9

// latencyRatios sets r's ratios to the minimal relay's run base, or, when
// either run's writers fell short of the offered rate (fsync-bound commits
// queue up, and notify mode always serializes them further), says so in
// r.RatioWithheld instead: below the rate the two runs carried different
// loads, and latency under a queue is the queue's.
func latencyRatios(r *Result, base Result, rate float64) {
	var short []string
	for _, run := range []struct {
		name string
		r    Result
	}{{"this project's", *r}, {"the minimal relay's", base}} {
		if run.r.EventsPerS < reachedRate*rate {
			short = append(short, fmt.Sprintf("%s writers reached %.0f of the %.0f TEDs/s offered", run.name, run.r.EventsPerS, rate))
		}
	}
	if len(short) > 0 {
		r.RatioWithheld = ptr(strings.Join(short, "; ") + fmt.Sprintf(" (under %.0f %%: the runs carried different loads)", reachedRate*100))
		return
	}
	if base.P50Ms > 0 && base.P99Ms > 0 {
		r.RatioP50ToBaseline = ptr(r.P50Ms / base.P50Ms)
		r.RatioP99ToBaseline = ptr(r.P99Ms / base.P99Ms)
	}
}

// latencyMinimal is the minimal relay's commit → stream on the schedule.
func latencyMinimal(ctx context.Context, e Env, rate float64, n int) (Result, error) {
	s, err := e.open(ctx, "latency_minimal", 64)
	if err != nil {
		return Result{}, err
	}
	defer s.close()
	if err := s.notifyMode(ctx, "always"); err != nil {
		return Result{}, err
	}
	if err := s.warm(ctx, 16); err != nil {
		return Result{}, err
	}
	f, err := startMinimalFlow(ctx, e, s)
	if err != nil {
		return Result{}, err
	}
	defer f.stop()
	warmSlow, err := f.warmUp(ctx, rate)
	if err != nil {
		return Result{}, err
	}
	start := time.Now()
	lag, err := openLoop(ctx, rate, n, f.settle)
	if err != nil {
		return Result{}, err
	}
	took := time.Since(start)
	if err := f.wait(30 * time.Second); err != nil {
		return Result{}, err
	}
	toStream, _ := f.latencies()
	if len(toStream) == 0 {
		return Result{}, errNoEvents
	}
	r := percentiles("latency_minimal_commit_to_stream", toStream, took,
		map[string]any{"rate": rate, "mode": "always", "relays": 1, "relay": "minimal", "poll": "50ms", "broker": s.broker(),
			"warm_up": warmUp.String()})
	r.OverOneS, r.WarmUpOverOneS = overOneSecond(toStream), ptr(warmSlow.toStream)
	r.Errors = ptr(f.errs.Load())
	r.MaxScheduleLagMs = ptr(ms(lag))
	return r, nil
}

// Horizon is a latency run behind a held horizon: with Hold, a transaction
// with an xid stays open from before a backlog of Behind events (aggregate
// type "backlog", a stream of their own) is published to the end of the
// run, so that every read meets the index entries their marks left.
type Horizon struct {
	Hold   bool
	Behind int
}

func latency(ctx context.Context, e Env, rate float64, n int, mode string, h Horizon) ([]Result, error) {
	s, err := e.open(ctx, "latency", 64)
	if err != nil {
		return nil, err
	}
	defer s.close()
	if err := s.notifyMode(ctx, mode); err != nil {
		return nil, err
	}
	if err := s.warm(ctx, 16); err != nil {
		return nil, err
	}
	f, err := startFlow(ctx, e, s, true)
	if err != nil {
		return nil, err
	}
	defer f.stop()
	release, err := s.holdHorizon(ctx, h.Hold)
	if err != nil {
		return nil, err
	}
	defer release()
	if h.Hold && h.Behind > 0 {
		if err := s.publishBehind(ctx, h.Behind); err != nil {
			return nil, err
		}
	}
	warmSlow, err := f.warmUp(ctx, rate)
	if err != nil {
		return nil, err
	}
	start := time.Now()
	lag, err := openLoop(ctx, rate, n, f.settle)
	if err != nil {
		return nil, err
	}
	took := time.Since(start)
	if err := f.wait(30 * time.Second); err != nil {
		return nil, err
	}
	toStream, toVerdict := f.latencies()
	if len(toStream) == 0 {
		return nil, errNoEvents
	}
	settings := map[string]any{"rate": rate, "mode": modeName(mode), "relays": 1, "consumers": 1, "poll": f.relay.Config().PollInterval.String(),
		"min_replicas": e.MinReplicas, "broker": s.broker(), "ownership": f.relay.Ownership(), "busy_rows": f.relay.Config().BusyRows,
		"warm_up": warmUp.String(), "horizon_held": h.Hold}
	if h.Hold {
		settings["behind"] = h.Behind
	}
	out := []Result{
		percentiles("latency_commit_to_stream", toStream, took, settings),
		percentiles("latency_commit_to_verdict", toVerdict, took, settings),
	}
	out[0].OverOneS, out[0].WarmUpOverOneS = overOneSecond(toStream), ptr(warmSlow.toStream)
	out[1].OverOneS, out[1].WarmUpOverOneS = overOneSecond(toVerdict), ptr(warmSlow.toVerdict)
	polls := f.relay.Stats().PollsWithWork
	for i := range out {
		out[i].Errors = ptr(f.errs.Load())
		out[i].MaxScheduleLagMs = ptr(ms(lag))
		out[i].PollsWithWork = ptr(polls)
	}
	return out, nil
}

// publishBehind inserts n events of aggregate type "backlog" and waits for
// the relay to publish them all.
func (s *space) publishBehind(ctx context.Context, n int) error {
	_, err := s.pool.Exec(ctx, `INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, partition_key)
		SELECT 'backlog', 'b-' || (g % 1000), 'backlog.filled', jsonb_build_object('n', g), 'b-' || (g % 1000)
		  FROM generate_series(1, $1::int) g`, n)
	if err != nil {
		return fmt.Errorf("insert the backlog behind the horizon: %w", err)
	}
	deadline := time.Now().Add(10 * time.Minute)
	for {
		var left int
		if err := s.pool.QueryRow(ctx, "SELECT count(*) FROM outbox_messages WHERE aggregate_type = 'backlog' AND status <> 'published'").Scan(&left); err != nil {
			return err
		}
		if left == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d events of the backlog behind the horizon still unpublished after 10m", left)
		}
		time.Sleep(200 * time.Millisecond)
	}
}
