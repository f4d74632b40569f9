package bench

import (
	"context"
	"time"
)

// Latency settles n TEDs at rate per second on an open-loop schedule, with one
// relay and one anti-fraud consumer, and measures, from the moment each
// Settle returned, commit → stream entry (seen by a separate XREAD reader)
// and commit → verdict. It returns both results; their events_per_s is the
// rate achieved (events over the writing phase). mode, when not empty, is
// the notify mode to switch to first (outbox_notify_mode).
func Latency(ctx context.Context, e Env, rate float64, n int, mode string) ([]Result, error) {
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
		"min_replicas": e.MinReplicas, "broker": s.broker()}
	out := []Result{
		percentiles("latency_commit_to_stream", toStream, took, settings),
		percentiles("latency_commit_to_verdict", toVerdict, took, settings),
	}
	out[0].OverOneS, out[1].OverOneS = overOneSecond(toStream), overOneSecond(toVerdict)
	polls := f.relay.Stats().PollsWithWork
	for i := range out {
		out[i].Errors = ptr(f.errs.Load())
		out[i].MaxScheduleLagMs = ptr(ms(lag))
		out[i].PollsWithWork = ptr(polls)
	}
	return out, nil
}
