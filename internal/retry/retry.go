// Package retry holds the two pieces every retry loop here needs: an
// exponential backoff with jitter, and a sleep that ends with its context.
package retry

import (
	"context"
	"math/rand/v2"
	"time"
)

// Backoff returns the delay after n consecutive failures (n >= 1):
// exponential from base, capped at max, with "equal jitter" (a random point
// in the upper half) so that retries of many clients do not fire in lockstep.
func Backoff(n int, base, max time.Duration) time.Duration {
	d := base
	for i := 1; i < n && d < max; i++ {
		d *= 2
	}
	d = min(d, max)
	half := d / 2
	return half + rand.N(d-half+1)
}

// Sleep waits for d or until ctx is done.
func Sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
