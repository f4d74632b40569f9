package demo

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/partition"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/transfer"
)

// --- 1 ----------------------------------------------------------------------

func (d *demo) oneByOne(ctx context.Context) error {
	rl, err := d.startRelay("demo-relay-1", relay.DefaultLease)
	if err != nil {
		return err
	}
	d.relay = rl
	fmt.Fprintf(d.Out, "   relay %q LISTENs on %q; its fallback poll is %s, so only NOTIFY makes it this fast\n",
		"demo-relay-1", relay.DefaultChannel, relay.DefaultPollInterval)

	teds := []struct {
		transfer.Transfer
		want string
	}{
		{transfer.Transfer{FromAccount: "ana", ToAccount: "bruno", AmountCents: 12_500_00}, "approve"},
		{transfer.Transfer{FromAccount: "carla", ToAccount: "davi", AmountCents: 4_990_00}, "approve"},
		{transfer.Transfer{FromAccount: "ana", ToAccount: "edu", AmountCents: 45_000_00}, "approve"},
		// Below the R$ 50.000 single-TED limit, but ana's hour reaches R$ 106.500: the velocity rule.
		{transfer.Transfer{FromAccount: "ana", ToAccount: "fabi", AmountCents: 49_000_00}, "review"},
		{transfer.Transfer{FromAccount: "gil", ToAccount: "ana", AmountCents: 32_10}, "approve"},
	}
	for _, ted := range teds {
		t := ted.Transfer
		t.ID = uuid.New()
		res, err := d.settle(ctx, t)
		if err != nil {
			return err
		}
		if !waitFor(ctx, 10*time.Second, func() bool { return d.tl.get(res.EventID).done() }) {
			d.check(false, "TED %s → %s reached anti-fraud within 10s", t.FromAccount, t.ToAccount)
			continue
		}
		line := d.tl.get(res.EventID)
		fmt.Fprintf(d.Out, "   TED %-5s → %-5s R$ %9s  %s\n", t.FromAccount, t.ToAccount, transfer.FormatBRL(t.AmountCents), d.timeline(line))
		d.check(line.verdict == ted.want, "verdict %s (want %s)", d.verdictText(line.verdict), ted.want)
	}

	_, err = transfer.Settle(ctx, d.Pool, transfer.Transfer{ID: uuid.New(), FromAccount: "ana", ToAccount: "ana", AmountCents: 100})
	d.check(errors.Is(err, transfer.ErrInvalid), "a TED to the sender's own account is refused before anything is written (%v)", err)
	return nil
}

func (d *demo) timeline(t timeline) string { return d.paint(t.String(), dim) }

func (d *demo) verdictText(v string) string {
	if v == "review" {
		return d.paint("REVIEW", yellow)
	}
	return d.paint(v, green)
}

// --- 2 ----------------------------------------------------------------------

func (d *demo) deadRelay(ctx context.Context) error {
	if !d.FailPoints {
		// The crash point is compiled only into binaries built with
		// -tags failpoint: a product binary ignores OUTBOX_FAILPOINT.
		d.notRun++
		fmt.Fprintln(d.Out, "   not run: this binary has no fail points to crash the relay at (make demo builds with -tags failpoint)")
		return nil
	}
	d.relay.stop()
	d.relay = nil
	before := d.report(ctx)

	var ids []uuid.UUID
	for i := range 3 {
		t := transfer.Transfer{ID: uuid.New(), FromAccount: fmt.Sprintf("hugo-%d", i), ToAccount: "iris", AmountCents: int64(1000 * (i + 1))}
		if _, err := d.settle(ctx, t); err != nil {
			return err
		}
		ids = append(ids, t.ID)
	}
	fmt.Fprintln(d.Out, "   3 TEDs settled with no relay running; now a relay process starts, claims them and is SIGKILLed")
	lease := 2 * time.Second
	// Bounded: if another relay on this database claims the rows first, the
	// fail point never fires and the process would run on.
	doomedCtx, cancelDoomed := context.WithTimeout(ctx, 30*time.Second)
	defer cancelDoomed()
	cmd := exec.CommandContext(doomedCtx, d.Binary, "relay", "--name", "doomed-relay", "--stream-prefix", d.StreamPrefix,
		"--lease", lease.String(), "--log-level", "error", "--partitions", strconv.Itoa(max(d.Partitions, 1)),
		"--ownership", relay.OwnRows) // the scenario shows a row claim and its reaping
	cmd.Env = append(os.Environ(), "DATABASE_URL="+d.DatabaseURL, "REDIS_URL="+d.RedisURL, "OUTBOX_FAILPOINT=relay.after-claim",
		"REDIS_CLUSTER="+strconv.FormatBool(d.Cluster))
	out, err := cmd.CombinedOutput()
	killed := false
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		killed = strings.Contains(exit.String(), "killed") && doomedCtx.Err() == nil // its fail point, not the timeout
	}
	d.check(killed, "the relay process died right after its claim (%v)", strings.TrimSpace(string(out)+" "+fmt.Sprint(err)))
	stuck := d.count(ctx, "SELECT count(*) FROM outbox_messages WHERE status = 'publishing' AND claimed_by = 'doomed-relay'")
	d.check(stuck == 3, "its 3 rows are left 'publishing' under its claim (%d)", stuck)

	started := time.Now()
	rl, err := d.startRelay("demo-relay-2", lease)
	if err != nil {
		return err
	}
	d.relay = rl
	fmt.Fprintf(d.Out, "   relay %q starts; the lease is %s (30s by default)\n", "demo-relay-2", lease)
	// Anti-fraud may judge an event before the relay's mark (sent with its
	// next claim) commits: wait for both.
	publishedBy2 := func() int {
		return d.count(ctx, `SELECT count(*) FROM outbox_messages
			WHERE aggregate_id = ANY($1) AND status = 'published' AND claimed_by = 'demo-relay-2'`, uuidStrings(ids))
	}
	ok := waitFor(ctx, 20*time.Second, func() bool {
		return d.report(ctx).Verdicts-before.Verdicts == 3 && publishedBy2() == 3
	})
	published := publishedBy2()
	fmt.Fprintf(d.Out, "   the reaper returned %d expired claims; published and judged %.1fs after the new relay started\n",
		rl.Stats().Reaped, time.Since(started).Seconds())
	after := d.report(ctx)
	d.check(ok && published == 3 && after.Verdicts-before.Verdicts == 3,
		"all 3 published by demo-relay-2 and judged exactly once (%d published, %d verdicts)", published, after.Verdicts-before.Verdicts)
	return nil
}

// --- 3 ----------------------------------------------------------------------

func (d *demo) duplicate(ctx context.Context) error {
	// The last entry of the first partition stream that has one.
	var (
		stream  string
		entries []redis.XMessage
	)
	for _, s := range partition.Streams(d.StreamPrefix+transfer.AggregateType, max(d.Partitions, 1)) {
		var err error
		if entries, err = d.Redis.XRevRangeN(ctx, s, "+", "-", 1).Result(); err != nil {
			return fmt.Errorf("read the last stream entry: %w", err)
		}
		if stream = s; len(entries) > 0 {
			break
		}
	}
	if len(entries) == 0 {
		return errors.New("no stream entry to add again")
	}
	before := d.report(ctx)
	values := make([]any, 0, 2*len(entries[0].Values))
	for k, v := range entries[0].Values {
		values = append(values, k, v)
	}
	if err := d.Redis.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: values}).Err(); err != nil {
		return err
	}
	fmt.Fprintf(d.Out, "   event %v added to the stream again, as a relay that died between XADD and its mark would\n", entries[0].Values["event_id"])
	waitFor(ctx, 5*time.Second, func() bool { return d.report(ctx).DuplicatesSkipped > before.DuplicatesSkipped })
	after := d.report(ctx)
	d.check(after.DuplicatesSkipped == before.DuplicatesSkipped+1, "anti-fraud recognised the duplicate by its event_id (duplicates skipped %d → %d)",
		before.DuplicatesSkipped, after.DuplicatesSkipped)
	d.check(after.Verdicts == before.Verdicts, "and applied nothing twice (verdicts stay %d)", after.Verdicts)
	return nil
}

// --- 4 ----------------------------------------------------------------------

func (d *demo) redisDown(ctx context.Context) error {
	before := d.report(ctx)
	d.redisReachable(false)
	fmt.Fprintln(d.Out, "   Redis is unreachable for the relay and anti-fraud now")
	const n = 200
	var failed int
	for i := range n {
		t := transfer.Transfer{ID: uuid.New(), FromAccount: fmt.Sprintf("jo-%02d", i%20), ToAccount: "kim", AmountCents: int64(100 + i)}
		if _, err := d.settle(ctx, t); err != nil {
			failed++
		}
	}
	time.Sleep(time.Second)
	pending := d.count(ctx, "SELECT count(*) FROM outbox_messages WHERE unpublished")
	fmt.Fprintf(d.Out, "   %d TEDs settled meanwhile; the outbox holds %d pending events\n", n-failed, pending)
	d.check(failed == 0 && pending == n, "every settlement committed while Redis was down, and waits in the outbox (%d failed, %d pending)", failed, pending)

	d.redisReachable(true)
	back := time.Now()
	fmt.Fprintln(d.Out, "   Redis is back")
	ok := waitFor(ctx, 30*time.Second, func() bool { return d.report(ctx).Verdicts-before.Verdicts == n })
	drained := time.Since(back)
	burnt := d.count(ctx, "SELECT count(*) FROM outbox_messages WHERE attempts > 0 AND status <> 'published'")
	dead := d.count(ctx, "SELECT count(*) FROM outbox_messages WHERE status = 'dead'")
	d.check(ok && dead == 0, "the outbox drained %.1fs after Redis returned; all %d judged, none dead (%d dead)", drained.Seconds(), n, dead)
	d.check(burnt == 0, "the outage cost no event a publish attempt (%d rows charged)", burnt)
	return nil
}

// --- 5 ----------------------------------------------------------------------

func (d *demo) burst(ctx context.Context) error {
	n, workers := 3000, 4
	if d.Short {
		n = 600
	}
	before := d.report(ctx)
	fmt.Fprintf(d.Out, "   %d TEDs from %d concurrent writers between 200 accounts, with one relay and one consumer\n", n, workers)
	var (
		next     atomic.Int64
		failures atomic.Int64
		ids      = make([]uuid.UUID, n)
		wg       sync.WaitGroup
	)
	start := time.Now()
	for range workers {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= n || ctx.Err() != nil {
					return
				}
				from := i % 200
				t := transfer.Transfer{ID: uuid.New(), FromAccount: fmt.Sprintf("acct-%03d", from),
					ToAccount: fmt.Sprintf("acct-%03d", (from+1+i%199)%200), AmountCents: int64(1 + (i*7919)%200_000)}
				res, err := d.settle(ctx, t)
				if err != nil {
					failures.Add(1)
					continue
				}
				ids[i] = res.EventID
			}
		})
	}
	judged := func() int { return int(d.report(ctx).Verdicts - before.Verdicts) }
	bar := d.progress(n)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	settledAt := time.Duration(0)
	for {
		j := judged()
		bar(j)
		if settledAt == 0 {
			select {
			case <-done:
				settledAt = time.Since(start)
			default:
			}
		}
		if j >= n-int(failures.Load()) && settledAt > 0 || time.Since(start) > 2*time.Minute || ctx.Err() != nil {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	elapsed := time.Since(start)
	j := judged()
	bar(j)
	fmt.Fprintln(d.Out)

	var lat, toPublish, toVerdict []time.Duration
	for _, id := range ids {
		if t := d.tl.get(id); t.done() {
			lat = append(lat, t.at[stepVerdict].Sub(t.at[stepCommitted]))
			toPublish = append(toPublish, t.at[stepPublished].Sub(t.at[stepCommitted]))
			toVerdict = append(toVerdict, t.at[stepVerdict].Sub(t.at[stepPublished]))
		}
	}
	quantile := func(xs []time.Duration, q float64) float64 {
		if len(xs) == 0 {
			return 0
		}
		slices.Sort(xs)
		return float64(xs[min(len(xs)-1, int(q*float64(len(xs))))].Microseconds()) / 1000
	}
	p := func(q float64) float64 { return quantile(lat, q) }
	fmt.Fprintf(d.Out, "   settled %d in %.2fs (%.0f TED/s); all judged after %.2fs (%.0f/s end to end)\n",
		n-int(failures.Load()), settledAt.Seconds(), float64(n)/settledAt.Seconds(), elapsed.Seconds(), float64(j)/elapsed.Seconds())
	fmt.Fprintf(d.Out, "   commit → verdict: p50 %.1f ms, p90 %.1f ms, p99 %.1f ms, max %.1f ms (p50 commit → XADD %.1f ms, XADD → verdict %.1f ms)\n",
		p(0.5), p(0.9), p(0.99), p(1), quantile(toPublish, 0.5), quantile(toVerdict, 0.5))
	d.check(failures.Load() == 0 && j == n, "all %d TEDs settled and judged exactly once (%d judged, %d failed)", n, j, failures.Load())
	return nil
}

// progress returns a function that draws a progress bar for done of total.
func (d *demo) progress(total int) func(done int) {
	last := 0 // quarters printed
	return func(done int) {
		pct := done * 100 / max(total, 1)
		if d.Color {
			const width = 40
			filled := pct * width / 100
			fmt.Fprintf(d.Out, "\r   [%s%s] %3d%%  %d/%d judged", strings.Repeat("█", filled), strings.Repeat("·", width-filled), pct, done, total)
			return
		}
		for ; last < pct/25; last++ {
			fmt.Fprintf(d.Out, "   %3d%%  %d/%d judged\n", (last+1)*25, done, total)
		}
	}
}

func uuidStrings(ids []uuid.UUID) []string {
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = id.String()
	}
	return out
}
