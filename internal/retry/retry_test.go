package retry

import (
	"context"
	"testing"
	"time"
)

func TestBackoffGrowsWithJitterAndCap(t *testing.T) {
	base, maxD := 100*time.Millisecond, 2*time.Second
	for n := 1; n <= 12; n++ {
		want := min(base<<(n-1), maxD)
		for range 50 {
			d := Backoff(n, base, maxD)
			if d < want/2 || d > want {
				t.Fatalf("Backoff(%d) = %s, want within [%s, %s]", n, d, want/2, want)
			}
		}
	}
}

func TestSleepEndsWithContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	start := time.Now()
	Sleep(ctx, time.Hour)
	if time.Since(start) > time.Second {
		t.Fatal("Sleep ignored a cancelled context")
	}
}
