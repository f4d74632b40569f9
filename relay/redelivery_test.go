package relay_test

import (
	"context"
	"github.com/tedbank/outbox/internal/relaytest"
	"net"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox"
	"github.com/tedbank/outbox/internal/outboxtest"
)

// The redelivery window is a bound. An event that may
// have reached the broker longer than the window ago, never marked
// published, is not published again (its consumers' dedupe records may be
// gone): it goes dead with the reason, and the later events of its key go
// on.
func TestEventPastItsRedeliveryWindowGoesDead(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ids := f.writeKey("sender-1", 2)
	f.Exec(`UPDATE outbox_messages SET first_sent_at = now() - interval '2 hours', attempts = 1 WHERE id = $1`, ids[0])
	cfg := f.RelayConfig("r1")
	cfg.Redelivery, cfg.ReapInterval = time.Hour, 50*time.Millisecond
	r := f.NewRelay(cfg, nil)
	f.Run(r.Run)
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		return f.Count(`SELECT count(*) FROM outbox_messages WHERE id = $1 AND status = 'dead' AND last_error LIKE 'redelivery window passed%'`, ids[0]) == 1 &&
			f.Count(`SELECT count(*) FROM outbox_messages WHERE id = $1 AND status = 'published'`, ids[1]) == 1
	}, "the event past its window is not dead, or the next one of its key was not published")
	if got := f.Entries(f.Stream()); !slices.Equal(got, []string{ids[1].String()}) {
		t.Fatalf("stream %v: the event past its window was published again (want only %s)", got, ids[1])
	}
}

// A publish whose reply was lost may have reached the broker: the rows'
// window starts (first_sent_at). One whose connection was never made did
// not: no window starts, and a long outage does not kill the events.
func TestPublishThatMayHaveLandedStartsTheWindow(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		err   error
		stamp bool
	}{
		{"reply timed out", &net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}, true},
		{"connection refused", &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", errRefused)}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			ids := f.writeKey("sender-1", 1)
			r := f.NewRelay(f.RelayConfig("r1"), &failingXAdd{Client: f.Redis.Client, err: tc.err})
			if res, err := relaytest.DrainBatch(f.Ctx, r); err != nil || !res.BrokerDown {
				t.Fatalf("DrainBatch: %+v, %v: want the broker down", res, err)
			}
			stamped := f.Count(`SELECT count(*) FROM outbox_messages WHERE id = $1 AND first_sent_at IS NOT NULL AND status = 'pending' AND attempts = 0`, ids[0]) == 1
			if stamped != tc.stamp {
				t.Fatalf("%s: first_sent_at set = %v, want %v (and the row pending, no attempt counted)", tc.name, stamped, tc.stamp)
			}
		})
	}
}

var errRefused = &os.SyscallError{Syscall: "connect", Err: os.ErrPermission}

// failingXAdd runs the pipeline for real (the entries land), then reports
// err for every XADD, as a reply lost on the way back would.
type failingXAdd struct {
	*redis.Client
	err error
}

func (c *failingXAdd) Pipelined(ctx context.Context, fn func(redis.Pipeliner) error) ([]redis.Cmder, error) {
	var xadds []*redis.StringCmd
	cmds, err := c.Client.Pipelined(ctx, func(p redis.Pipeliner) error {
		return fn(capturePipe{Pipeliner: p, xadds: &xadds})
	})
	for _, x := range xadds {
		x.SetErr(c.err)
	}
	return cmds, err
}

type capturePipe struct {
	redis.Pipeliner
	xadds *[]*redis.StringCmd
}

func (p capturePipe) XAdd(ctx context.Context, a *redis.XAddArgs) *redis.StringCmd {
	cmd := p.Pipeliner.XAdd(ctx, a)
	*p.xadds = append(*p.xadds, cmd)
	return cmd
}

// writeKey writes n events of one partition key, in one transaction each,
// and returns their ids in commit order.
func (f *fixture) writeKey(key string, n int) []uuid.UUID {
	f.T.Helper()
	var ids []uuid.UUID
	for range n {
		err := pgx.BeginFunc(f.Ctx, f.Pool, func(tx pgx.Tx) error {
			w, err := outbox.Write(f.Ctx, tx, outbox.Message{AggregateType: "transfer", AggregateID: uuid.NewString(),
				EventType: "transfer.settled", PartitionKey: key, Payload: []byte(`{}`)})
			if err == nil {
				ids = append(ids, w[0].ID)
			}
			return err
		})
		if err != nil {
			f.T.Fatal(err)
		}
	}
	return ids
}
