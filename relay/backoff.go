package relay

import (
	"math/rand/v2"
	"time"
)

// backoff returns the delay before attempt n+1 after n failed attempts:
// exponential from base, capped at max, with "equal jitter" (a random point in
// the upper half) so that retries of many events do not fire in lockstep.
func backoff(n int, base, max time.Duration) time.Duration {
	d := base
	for i := 1; i < n && d < max; i++ {
		d *= 2
	}
	d = min(d, max)
	half := d / 2
	return half + rand.N(d-half+1)
}
