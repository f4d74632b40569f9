package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/partition"
	"github.com/tedbank/outbox/transfer"
)

// Consume preloads n transfer.settled entries into a stream — round(n*dup) of
// them re-adds of an earlier entry's event (a relay's duplicate), the rest
// distinct — with pipelined XADDs of 500 shaped as the relay writes them, then
// runs K anti-fraud consumers of one group and times them until every entry
// is processed and acknowledged. events_per_s counts entries, duplicates
// included; the consumers' own counters must then show every distinct event
// applied once and every duplicate skipped, or it is an error.
func Consume(ctx context.Context, e Env, n, consumers, batch int, dup float64) (Result, error) {
	s, err := e.open(ctx, "consume", 2)
	if err != nil {
		return Result{}, err
	}
	defer s.close()
	stream := s.prefix + transfer.AggregateType
	dups := int(math.Round(float64(n) * dup))
	if n-dups < 1 {
		return Result{}, fmt.Errorf("want at least one distinct event, not %d duplicates of %d", dups, n)
	}
	if err := preload(ctx, s.rdb, stream, e.partitions(), n, dups); err != nil {
		return Result{}, fmt.Errorf("preload the stream: %w", err)
	}

	cs := make([]*fraud.Consumer, consumers)
	for i := range cs {
		if cs[i], err = fraud.New(s.rdb, fraud.Config{Stream: stream, KeyPrefix: s.prefix + "fraud:",
			Consumer: fmt.Sprintf("bench-%d", i), BatchSize: batch, Block: 100 * time.Millisecond, Logger: e.Log,
			Partitions: e.partitions()}); err != nil {
			return Result{}, err
		}
	}
	if err := cs[0].EnsureGroup(ctx); err != nil {
		return Result{}, err
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	rssBefore, rssOK := startRSS()
	start := time.Now()
	for _, c := range cs {
		wg.Go(func() { _ = c.Run(cctx) })
	}
	var processed, duplicates int64
	for {
		processed, duplicates = 0, 0
		for _, c := range cs {
			st := c.Stats()
			processed += st.Processed
			duplicates += st.Duplicates
		}
		// The counters move before the batch's XACK: done when nothing is
		// left pending either.
		if processed+duplicates >= int64(n) && nonePending(ctx, s.rdb, stream, e.partitions(), cs[0].Config().Group) {
			break
		}
		if err := ctx.Err(); err != nil {
			return Result{}, err
		}
		time.Sleep(2 * time.Millisecond)
	}
	took := time.Since(start)
	res := Result{Scenario: "consume", N: n, Seconds: took.Seconds(), EventsPerS: float64(n) / took.Seconds(),
		Settings: map[string]any{"consumers": consumers, "batch": batch, "duplicate_fraction": dup, "distinct": n - dups,
			"partitions": e.partitions()}}
	stopRSS(&res, rssBefore, rssOK)
	cancel()
	wg.Wait()
	// Exactly once in effect: one verdict per distinct event. The
	// consumers' own counters may count an applied event as a duplicate
	// when the reply to its effect was lost and the entry was applied again
	// (a timeout on a busy server): that is at-least-once delivery doing its
	// job, reported in duplicates.
	rep, err := fraud.ReadReport(ctx, s.rdb, fraud.Keys{Prefix: s.prefix + "fraud:", Partitions: e.partitions()})
	if err != nil {
		return Result{}, err
	}
	if rep.Verdicts != int64(n-dups) || processed+duplicates != int64(n) {
		return Result{}, fmt.Errorf("%d verdicts for %d distinct events (the consumers applied %d and skipped %d of %d entries)",
			rep.Verdicts, n-dups, processed, duplicates, n)
	}
	if duplicates != int64(dups) {
		e.Log.Warn("entries applied again after a lost reply (counted as duplicates)", "extra", duplicates-int64(dups))
	}
	res.Duplicates = ptr(duplicates)
	return res, nil
}

// nonePending reports whether the group has no entry pending in any
// partition of stream.
func nonePending(ctx context.Context, rdb redis.Cmdable, stream string, parts int, group string) bool {
	for _, s := range partition.Streams(stream, parts) {
		p, err := rdb.XPending(ctx, s, group).Result()
		if err != nil || p.Count != 0 {
			return false
		}
	}
	return true
}

// preload XADDs n entries, dups of them copies of an earlier entry's event,
// each to its sender's partition of stream.
func preload(ctx context.Context, rdb redis.UniversalClient, stream string, parts, n, dups int) error {
	isDup := make([]bool, n)
	for _, i := range rand.Perm(n - 1)[:dups] {
		isDup[i+1] = true // never the first
	}
	var (
		events [][]any  // earlier entries' values, for the duplicates
		target []string // and the stream each went to
		pipe   = rdb.Pipeline()
		seq    int64
	)
	flush := func() error {
		if pipe.Len() == 0 {
			return nil
		}
		_, err := pipe.Exec(ctx)
		return err
	}
	now := time.Now().UTC()
	for i := range n {
		var (
			values []any
			to     string
		)
		if isDup[i] {
			j := rand.IntN(len(events))
			values, to = events[j], target[j]
		} else {
			seq++
			from := rand.IntN(1000)
			ev := transfer.SettledEvent{SchemaVersion: transfer.SchemaVersion, EventID: uuid.New(), TransferID: uuid.New(),
				FromAccount: fmt.Sprintf("acct-%03d", from), ToAccount: fmt.Sprintf("acct-%03d", (from+1+rand.IntN(999))%1000),
				AmountCents: amount(), Currency: transfer.DefaultCurrency, SettledAt: now}
			payload, err := json.Marshal(ev)
			if err != nil {
				return err
			}
			values = []any{"event_id", ev.EventID.String(), "event_type", transfer.EventSettled,
				"aggregate_type", transfer.AggregateType, "aggregate_id", ev.TransferID.String(),
				"payload", payload, "headers", `{"schema_version":"1"}`,
				"occurred_at", now.Format(time.RFC3339Nano), "seq", seq}
			to = partition.Stream(stream, partition.Of(ev.FromAccount, parts), parts)
			events, target = append(events, values), append(target, to)
		}
		pipe.XAdd(ctx, &redis.XAddArgs{Stream: to, Values: values})
		if pipe.Len() == 500 {
			if err := flush(); err != nil {
				return err
			}
		}
	}
	return flush()
}
