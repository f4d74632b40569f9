package relay_test

import (
	"context"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/relay"
)

// Big payloads are batched by bytes as well as rows: a batch holds events
// up to Config.BatchBytes (the smallest first; at least one), so the relay's
// memory and each publish are bounded by bytes, not by the batch size, and
// the small events of other keys behind a burst of big ones go out in the
// first batch instead of waiting for them.
func TestBigPayloadsAreBatchedByBytes(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	const (
		big      = 1 << 20 // raw bytes of each big payload
		bigs     = 20
		budget   = 3 << 20
		smallTED = 5
	)
	// A SQL writer's burst of big events, each of its own key, then TEDs.
	f.Exec(`INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload)
		SELECT 'blob', 'b-' || g, 'blob.stored', jsonb_build_object('data', repeat('x', $1))
		  FROM generate_series(1, $2) g`, big, bigs)
	teds := f.Settle(smallTED)

	var mu sync.Mutex
	var batches [][]uuid.UUID
	cfg := f.RelayConfig("r1")
	cfg.BatchBytes = budget
	cfg.Observer = relay.Hooks{OnClaim: func(ids []uuid.UUID) {
		mu.Lock()
		batches = append(batches, slices.Clone(ids))
		mu.Unlock()
	}}
	f.Run(f.NewRelay(cfg, nil).Run)
	outboxtest.Eventually(t, 30*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == bigs+smallTED
	}, "not every event was published")

	mu.Lock()
	defer mu.Unlock()
	small := map[string]bool{}
	for _, ted := range teds {
		var id string
		if err := f.Pool.QueryRow(f.Ctx, "SELECT id::text FROM outbox_messages WHERE aggregate_id = $1", ted.ID.String()).Scan(&id); err != nil {
			t.Fatal(err)
		}
		small[id] = true
	}
	for i, b := range batches {
		var bytes int
		if err := f.Pool.QueryRow(f.Ctx, "SELECT coalesce(sum(octet_length(payload::text)), 0) FROM outbox_messages WHERE id = ANY($1)", b).Scan(&bytes); err != nil {
			t.Fatal(err)
		}
		if len(b) > 1 && bytes > budget+big+1024 {
			t.Errorf("batch %d: %d events, %d bytes of payload: over the budget %d (+ one event)", i, len(b), bytes, budget)
		}
	}
	var first []string
	for _, id := range batches[0] {
		first = append(first, id.String())
	}
	for id := range small {
		if !slices.Contains(first, id) {
			t.Fatalf("small event %s was not in the first batch (%d events: %s): it waited behind the big ones",
				id, len(first), strings.Join(first, " "))
		}
	}
	t.Logf("%d batches for %d big events of %d bytes and %d small ones, budget %d bytes", len(batches), bigs, big, smallTED, budget)
}

// A payload over the documented limit (16 MiB raw, migration 0016) is
// refused where it is written, with the constraint's name in the error; one
// at the limit is written and its raw size kept for the relays' byte budget.
func TestPayloadOverTheLimitIsRefusedWhereItIsWritten(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	insert := `INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload)
		VALUES ('blob', $1, 'blob.stored', jsonb_build_object('data', repeat('x', $2)))`
	_, err := f.Pool.Exec(f.Ctx, insert, "too-big", 16<<20)
	if err == nil || !strings.Contains(err.Error(), "outbox_messages_payload_size") {
		t.Fatalf("a 16 MiB payload (plus its JSON): %v, want refused by outbox_messages_payload_size", err)
	}
	f.Exec(insert, "fits", 15<<20)
	if n := f.Count("SELECT payload_bytes FROM outbox_messages WHERE aggregate_id = 'fits'"); n < 15<<20 {
		t.Fatalf("payload_bytes %d for a 15 MiB payload (compressed on disk): want its raw size", n)
	}
}

// A publish that times out is tried again smaller, not whole: here a Redis
// that takes perXADD per entry, so that a pipeline of more than 8 cannot
// make the publish timeout. The relay halves its batches until they fit,
// and every event is published (retried whole, the batch of 20 never was).
func TestPublishThatTimesOutIsRetriedSmaller(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.Settle(20) // 20 senders: one claim takes them all
	slow := &slowRedis{Client: f.Redis.Client, perXADD: 50 * time.Millisecond}
	cfg := f.RelayConfig("r1")
	cfg.PublishTimeout = 400 * time.Millisecond
	f.Run(f.NewRelay(cfg, slow).Run)
	outboxtest.Eventually(t, 15*time.Second, func() bool {
		return f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'") == 20
	}, "the batch that timed out was never published: %d of 20", f.Count("SELECT count(*) FROM outbox_messages WHERE status = 'published'"))
	if n := slow.largest.Load(); n > 8 {
		t.Fatalf("a pipeline of %d entries was taken, more than fit the timeout", n)
	}
}

// slowRedis takes perXADD per entry of a pipeline: one that cannot end
// before the publish's deadline fails every entry with the deadline, as a
// real pipeline cut off by its context does, without running.
type slowRedis struct {
	*redis.Client
	perXADD time.Duration
	largest atomic.Int64 // the largest pipeline that ran
}

func (s *slowRedis) Pipelined(ctx context.Context, fn func(redis.Pipeliner) error) ([]redis.Cmder, error) {
	var queued []*redis.XAddArgs
	var cmds []*redis.StringCmd
	if err := fn(&queuingPipe{Pipeliner: s.Client.Pipeline(), add: func(a *redis.XAddArgs) *redis.StringCmd {
		cmd := redis.NewStringCmd(ctx)
		queued, cmds = append(queued, a), append(cmds, cmd)
		return cmd
	}}); err != nil {
		return nil, err
	}
	if d, ok := ctx.Deadline(); ok && time.Now().Add(time.Duration(len(queued))*s.perXADD).After(d) {
		for _, c := range cmds {
			c.SetErr(context.DeadlineExceeded)
		}
		return nil, context.DeadlineExceeded
	}
	time.Sleep(time.Duration(len(queued)) * s.perXADD)
	s.largest.Store(max(s.largest.Load(), int64(len(queued))))
	for i, a := range queued {
		id, err := s.Client.XAdd(ctx, a).Result()
		cmds[i].SetVal(id)
		cmds[i].SetErr(err)
	}
	return nil, nil
}

type queuingPipe struct {
	redis.Pipeliner
	add func(*redis.XAddArgs) *redis.StringCmd
}

func (p *queuingPipe) XAdd(_ context.Context, a *redis.XAddArgs) *redis.StringCmd { return p.add(a) }

// The oldest publishable event goes in the next batch whatever its size:
// smaller events that fill the byte budget by themselves (a steady flow of
// them) never keep a big one, and the later events of its key, waiting.
func TestOldestEventIsNeverLeftBehindSmallerOnes(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.Exec(`INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload)
		VALUES ('blob', 'big', 'blob.stored', jsonb_build_object('data', repeat('x', 1 << 20)))`)
	f.Exec(`INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload)
		SELECT 'blob', 'small-' || g, 'blob.stored', jsonb_build_object('data', repeat('y', 10000))
		  FROM generate_series(1, 50) g`)
	var bigID uuid.UUID
	if err := f.Pool.QueryRow(f.Ctx, "SELECT id FROM outbox_messages WHERE aggregate_id = 'big'").Scan(&bigID); err != nil {
		t.Fatal(err)
	}
	first := make(chan []uuid.UUID, 1)
	cfg := f.RelayConfig("r1")
	cfg.BatchBytes = 100_000 // ten of the small ones fill it
	cfg.Observer = relay.Hooks{OnClaim: func(ids []uuid.UUID) {
		select {
		case first <- slices.Clone(ids):
		default:
		}
	}}
	f.Run(f.NewRelay(cfg, nil).Run)
	select {
	case ids := <-first:
		if !slices.Contains(ids, bigID) {
			t.Fatalf("the first batch (%d events) left the oldest event, a big one, behind the smaller ones", len(ids))
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no batch claimed")
	}
}
