package relay

import (
	"context"
	"slices"
	"testing"

	"github.com/google/uuid"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/queries"
	"github.com/tedbank/outbox/relay/redisbroker"
)

// markBy is a fence whose published mark is the statement sql.
type markBy string

func (f markBy) published(*pendingMark) queries.Statement { return queries.Statement{SQL: string(f)} }
func (f markBy) failed(*pendingMark, []int64, int) queries.Statement {
	return queries.Statement{SQL: string(f)}
}

// With partition leases, the last batch's mark runs beside the next batch:
// the next read leaves that batch's rows out while its mark may still be in
// flight, and stops leaving them out once it returns, whether the mark
// succeeded or failed (a failed mark leaves the rows pending, to be read
// again).
func TestMarkBesideTheNextBatchLeavesItsRowsOutOfTheRead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := outboxtest.Postgres(t)
	b, err := redisbroker.New(outboxtest.NewRedis(t).Client, redisbroker.Config{})
	if err != nil {
		t.Fatal(err)
	}
	r, err := New(pool, b, Config{Name: "beside", Ownership: OwnPartitions})
	if err != nil {
		t.Fatal(err)
	}
	p, ok := r.own.leases.(*partitionLeases)
	if !ok {
		t.Fatalf("partition leases keep %T", r.own.leases)
	}
	for _, c := range []struct {
		name    string
		mark    markBy
		wantErr bool
	}{
		{"the mark succeeds", "SELECT generate_series(1, 2)", false},
		{"the mark fails", "SELECT 1/0", true},
	} {
		prev := &pendingMark{ids: []uuid.UUID{uuid.New(), uuid.New()}, streamIDs: []string{"1-0", "2-0"},
			seqs: []int64{7, 9}, rows: []int{0, 1}, fence: c.mark}
		var during []int64
		var read queries.Statement
		res, _, err := p.drainBeside(ctx, prev, func() (BatchResult, *pendingMark, error) {
			during = slices.Clone(p.inFlight)
			read = p.read(uuid.Nil)
			return BatchResult{Claimed: 1}, nil, nil
		})
		if !slices.Equal(during, prev.seqs) {
			t.Errorf("%s: the read beside the mark left out %v, want %v", c.name, during, prev.seqs)
		}
		if !slices.ContainsFunc(read.Args, func(a any) bool { s, ok := a.([]int64); return ok && slices.Equal(s, prev.seqs) }) {
			t.Errorf("%s: the read's arguments %v do not leave out %v", c.name, read.Args, prev.seqs)
		}
		if p.inFlight != nil {
			t.Errorf("%s: rows %v still left out of reads after the mark returned", c.name, p.inFlight)
		}
		if after := p.read(uuid.Nil); slices.ContainsFunc(after.Args, func(a any) bool { s, ok := a.([]int64); return ok && len(s) > 0 }) {
			t.Errorf("%s: a later read still leaves rows out: %v", c.name, after.Args)
		}
		if gotErr := err != nil; gotErr != c.wantErr {
			t.Errorf("%s: error %v, want one: %v", c.name, err, c.wantErr)
		}
		if res.Claimed != 1 {
			t.Errorf("%s: result %+v, want the batch's", c.name, res)
		}
		if !c.wantErr && res.Published != 2 {
			t.Errorf("%s: %d published, want the mark's 2 counted", c.name, res.Published)
		}
	}
}
