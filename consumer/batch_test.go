package consumer

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/tedbank/outbox/internal/outboxtest"
)

// sizes is a Handler that applies every message and records each batch's
// size.
type sizes struct {
	mu    sync.Mutex
	seen  []int
	total int
}

func (s *sizes) Handle(_ context.Context, b Batch) []Result {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.seen = append(s.seen, len(b.Messages))
	s.total += len(b.Messages)
	res := make([]Result, len(b.Messages))
	for i := range res {
		res[i].Outcome = Applied
	}
	return res
}

func (s *sizes) snapshot() ([]int, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.seen), s.total
}

// Under a backlog each full read makes the next one ask for twice as many
// entries, up to MaxBatchSize, so that a batch's fixed costs are spread
// over more messages; once the consumer keeps up, reads are BatchSize
// again. MaxBatchSize = BatchSize keeps every batch at BatchSize.
func TestReadsGrowUnderABacklog(t *testing.T) {
	for _, tc := range []struct {
		max  int
		want []int // the batches of the 200-entry backlog
	}{
		{40, []int{10, 20, 40, 40, 40, 40, 10}},
		{10, slices.Repeat([]int{10}, 20)},
	} {
		rdb := outboxtest.NewRedis(t)
		cfg := testConfig(rdb, "c1")
		cfg.BatchSize, cfg.MaxBatchSize, cfg.Block = 10, tc.max, 50*time.Millisecond
		h := &sizes{}
		c := newGroupConsumer(t, rdb, h, cfg)
		for range 200 {
			publish(t, rdb, c.parts[0].stream, "a")
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- c.Run(ctx) }()
		waitFor := func(n int) []int {
			t.Helper()
			for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
				if seen, total := h.snapshot(); total >= n {
					return seen
				}
			}
			seen, total := h.snapshot()
			t.Fatalf("max %d: %d of %d messages handled, batches %v", tc.max, total, n, seen)
			return nil
		}
		if got := waitFor(200); !slices.Equal(got, tc.want) {
			t.Errorf("max %d: backlog of 200 handled in batches %v, want %v", tc.max, got, tc.want)
		}
		// Keeping up: one entry at a time, each read asks for BatchSize.
		for i := range 3 {
			publish(t, rdb, c.parts[0].stream, "a")
			waitFor(201 + i)
		}
		seen, _ := h.snapshot()
		if tail := seen[len(tc.want):]; !slices.Equal(tail, []int{1, 1, 1}) {
			t.Errorf("max %d: entries one at a time handled in batches %v, want one each", tc.max, tail)
		}
		if n, err := c.rdb.XLen(ctx, c.parts[0].stream).Result(); err != nil || n != 203 {
			t.Fatalf("stream length %d (%v)", n, err)
		}
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("Run: %v", err)
		}
	}
}

// failOnce is a Handler that fails the first delivery of each message of
// key bad (a transient failure) and applies everything else, keeping the
// keys in the order applied; each batch takes a millisecond.
type failOnce struct {
	bad     string
	mu      sync.Mutex
	tried   map[string]bool
	applied []string
}

func (h *failOnce) Handle(_ context.Context, b Batch) []Result {
	time.Sleep(time.Millisecond)
	h.mu.Lock()
	defer h.mu.Unlock()
	res := make([]Result, len(b.Messages))
	for i, m := range b.Messages {
		if m.Key == h.bad && !h.tried[m.EntryID] {
			h.tried[m.EntryID] = true
			res[i].Err = errors.New("transient failure (injected)")
			continue
		}
		h.applied = append(h.applied, m.Key)
		res[i].Outcome = Applied
	}
	return res
}

func (h *failOnce) position(key string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Index(h.applied, key)
}

// Under a backlog a worker reads ahead (it sends the next read before it
// applies the last one), but not past a retry that is due: an entry that
// failed transiently is retried within a few batches, not once the backlog
// is through.
func TestBacklogDoesNotPutOffRetries(t *testing.T) {
	rdb := outboxtest.NewRedis(t)
	cfg := testConfig(rdb, "c1")
	cfg.BatchSize, cfg.MaxBatchSize, cfg.Block = 10, 40, 50*time.Millisecond
	h := &failOnce{bad: "bad", tried: map[string]bool{}}
	c := newGroupConsumer(t, rdb, h, cfg)
	add := func(key string) { publishKeyed(t, rdb, c.parts[0].stream, key, key) }
	const backlog = 2000
	add("bad")
	for range backlog {
		add("a")
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	for deadline := time.Now().Add(20 * time.Second); h.position("bad") < 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the failed entry was never retried")
		}
	}
	// Its retry is due at once (the first backoff starts from zero): the
	// read already sent is applied, and then the retry, before more.
	if at := h.position("bad"); at > 4*cfg.MaxBatchSize {
		t.Fatalf("the failed entry was applied after %d entries of the backlog, want at most %d", at, 4*cfg.MaxBatchSize)
	}
}
