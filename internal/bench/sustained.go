package bench

import (
	"context"
	"math"
	"slices"
	"sync"
	"time"
)

// Sustained settles at rate TEDs per second for d on an open-loop schedule,
// with one relay and one anti-fraud consumer, and reports commit → verdict
// percentiles and the outbox backlog (rows pending or publishing) sampled
// every 100ms while writing. The backlog counts as bounded when the median
// sample of the last quarter of the writing phase is at most one second of
// arrivals (max(rate, 10) rows): a relay that keeps up leaves milliseconds'
// worth, one that falls behind accumulates the difference every second, and a
// single late batch (a fallback poll) is a spike, not a median. mode, when not
// empty, is the notify mode to switch to first (outbox_notify_mode).
func Sustained(ctx context.Context, e Env, rate float64, d time.Duration, mode string) (Result, error) {
	n := int(math.Ceil(rate * d.Seconds()))
	s, err := e.open(ctx, "sustained", 64)
	if err != nil {
		return Result{}, err
	}
	defer s.close()
	if err := s.notifyMode(ctx, mode); err != nil {
		return Result{}, err
	}
	if err := s.warm(ctx, 16); err != nil {
		return Result{}, err
	}
	f, err := startFlow(ctx, e, s, false)
	if err != nil {
		return Result{}, err
	}
	defer f.stop()

	type sample struct {
		at      time.Duration
		backlog int64
	}
	var (
		samples  []sample
		sampleMu sync.Mutex
		sampler  sync.WaitGroup
	)
	sctx, stopSampling := context.WithCancel(ctx)
	defer stopSampling()
	start := time.Now()
	sampler.Go(func() {
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-sctx.Done():
				return
			case <-t.C:
			}
			if b, err := s.backlog(sctx); err == nil {
				sampleMu.Lock()
				samples = append(samples, sample{time.Since(start), b})
				sampleMu.Unlock()
			}
		}
	})
	lag, err := openLoop(ctx, rate, n, f.settle)
	took := time.Since(start)
	stopSampling()
	sampler.Wait()
	if err != nil {
		return Result{}, err
	}
	if err := f.wait(30*time.Second + d); err != nil {
		return Result{}, err
	}
	_, toVerdict := f.latencies()
	if len(toVerdict) == 0 {
		return Result{}, errNoEvents
	}
	var maxBacklog int64
	var tail []int64
	for _, x := range samples {
		maxBacklog = max(maxBacklog, x.backlog)
		if x.at >= took*3/4 {
			tail = append(tail, x.backlog)
		}
	}
	bounded := true
	if len(tail) > 0 {
		slices.Sort(tail)
		bounded = float64(tail[(len(tail)-1)/2]) <= max(rate, 10)
	}
	r := percentiles("sustained", toVerdict, took, map[string]any{
		"rate": rate, "mode": modeName(mode), "duration": d.String(), "relays": 1, "consumers": 1,
		"poll": f.relay.Config().PollInterval.String(), "busy_rows": f.relay.Config().BusyRows, "ownership": f.relay.Ownership(), "backlog_samples": len(samples), "latency": "commit_to_verdict", "broker": s.broker()})
	r.Errors = ptr(f.errs.Load())
	r.MaxScheduleLagMs = ptr(ms(lag))
	r.PollsWithWork = ptr(f.relay.Stats().PollsWithWork)
	r.OverOneS = overOneSecond(toVerdict)
	r.MaxBacklog = ptr(maxBacklog)
	r.BacklogBounded = ptr(bounded)
	return r, nil
}
