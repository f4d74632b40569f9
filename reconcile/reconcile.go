// Package reconcile checks, end to end, that every settled TED reached
// anti-fraud: the daily reconciliation a bank runs beside the outbox.
//
// For the transfers settled since a point in time it checks that
//
//   - every transfer has its transfer.settled event (and no event lacks its
//     transfer), or, settled before the cleanup horizon (outbox cleanup
//     deletes published events), a verdict;
//   - every event older than the grace period is published;
//   - every published event older than the grace period has a verdict
//     (unless its verdict is past anti-fraud's retention), and when it has
//     none, whether its stream entry is still there (the consumer is behind)
//     or gone (deleted before anti-fraud read it: lost to it);
//   - each sender's anti-fraud totals over the retained days equal the sums
//     over the sender's transfers that have a verdict (a verdict and the day
//     totals it counts in expire together: fraud.Config.Retention);
//   - with the ledger example's database (Options.Ledger), every published
//     transfer older than the grace period is posted exactly once: its
//     debit and its credit, of its amount, on its accounts (ledger.go).
//
// It reads PostgreSQL in one streamed pass (a hash join, no lock a writer or
// a relay waits for) and Redis in pipelined batches, so it can run while
// everything runs; totals are read atomically with the verdicts they depend
// on, and a sender whose totals differ is read again before it is reported,
// so an effect applied meanwhile is not a false alarm.
package reconcile

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/queries"
	"github.com/tedbank/outbox/partition"
)

// Defaults of Options.
const (
	DefaultGrace = time.Minute
	DefaultSince = 24 * time.Hour
	// examples is how many ids of each kind of difference a report lists.
	examples = 20
	// batch is how many rows share one Redis round trip.
	batch = 1000
	// senderBatch is how many senders' totals are checked in one round trip.
	senderBatch = 200
	// totalsTries: a sender whose totals differ is read this many times.
	totalsTries = 3
	// expiryMargin: a verdict that expires this soon is not looked for.
	expiryMargin = 10 * time.Minute
)

// Options says what to reconcile.
type Options struct {
	Since time.Time     // transfers settled at or after it (zero: DefaultSince ago)
	Grace time.Duration // younger events may still be on their way (0: DefaultGrace)
	// Stream is the stream transfer events are published to (with several
	// partitions, the base of each partition's stream); KeyPrefix is
	// anti-fraud's key prefix.
	Stream, KeyPrefix string
	// Partitions is the relay's and anti-fraud's --partitions (0 or 1: one
	// stream). Against a Redis Cluster every read of one transaction stays
	// in one partition's slot.
	Partitions int
	// Retention is anti-fraud's (fraud.Config.Retention; 0: its default):
	// transfers whose verdict has expired are not expected to have one.
	Retention time.Duration
	// Now is the time the grace period counts back from (zero: time.Now).
	Now time.Time
	// ListLost lists every lost event (Report.Lost), not only the first
	// few: what outbox republish --report takes.
	ListLost bool
	// Ledger, when set, is the ledger example's database (package ledger):
	// every published transfer past the grace period must have exactly its
	// double entry there (Report.Ledger).
	Ledger *pgxpool.Pool
}

// Diff is one kind of difference: how many, and the first few ids.
type Diff struct {
	Count    int      `json:"count"`
	Examples []string `json:"examples"`
}

func (d *Diff) add(id string) {
	d.Count++
	if len(d.Examples) < examples {
		d.Examples = append(d.Examples, id)
	}
}

// SenderDiff is a sender whose anti-fraud totals differ from PostgreSQL's.
type SenderDiff struct {
	Account        string `json:"account"`
	FraudCents     int64  `json:"fraud_sent_cents"`
	FraudTransfers int64  `json:"fraud_transfers"`
	WantCents      int64  `json:"want_sent_cents"`
	WantTransfers  int64  `json:"want_transfers"`
}

// Report is what Run found. OK is true when nothing differs.
type Report struct {
	Since     time.Time `json:"since"`
	Grace     string    `json:"grace"`
	Transfers int       `json:"transfers"`
	Events    int       `json:"events"`
	// MissingEvent: transfers without a transfer.settled event (settled
	// after the cleanup horizon, or before it and without a verdict).
	MissingEvent Diff `json:"missing_event"`
	// CleanupHorizon is the latest cutoff of outbox cleanup (nil: it never
	// deleted anything): events published before it may be gone.
	CleanupHorizon *time.Time `json:"cleanup_horizon,omitempty"`
	// CleanedUp: transfers settled before the cleanup horizon without
	// their event, which cleanup deleted: judged by anti-fraud (or past
	// its retention), so nothing is missing.
	CleanedUp int `json:"cleaned_up"`
	// Orphan: events whose transfer is not in PostgreSQL.
	Orphan Diff `json:"orphan_event"`
	// Unpublished: events older than the grace period, not published.
	Unpublished Diff `json:"unpublished"`
	// NoVerdict: published events older than the grace period without a
	// verdict whose stream entry is still there (anti-fraud is behind).
	NoVerdict Diff `json:"no_verdict"`
	// NotInStream: published events older than the grace period without a
	// verdict whose stream entry is gone: anti-fraud will never see them.
	NotInStream Diff `json:"not_in_stream"`
	// Lost is every event of NotInStream, with Options.ListLost: the ids
	// outbox republish --report puts back to pending.
	Lost []string `json:"lost,omitempty"`
	// PastRetention: published events whose verdict has expired (or soon
	// will) with anti-fraud's retention; not looked up.
	PastRetention int `json:"past_retention"`
	// Senders: senders checked; TotalsDiffer: those whose totals differ
	// (the first few).
	Senders      int          `json:"senders"`
	TotalsDiffer int          `json:"totals_differ"`
	SenderDiffs  []SenderDiff `json:"sender_diffs"`
	// Ledger is the ledger's check, when Options.Ledger is set.
	Ledger *LedgerReport `json:"ledger,omitempty"`
	OK     bool          `json:"ok"`
}

// row is one line of reconcile_events.sql.
type row struct {
	TransferID       *string    `db:"transfer_id"`
	FromAccount      *string    `db:"from_account"`
	ToAccount        *string    `db:"to_account"`
	AmountCents      *int64     `db:"amount_cents"`
	SettledAt        *time.Time `db:"settled_at"`
	EventID          *string    `db:"event_id"`
	EventAggregateID *string    `db:"event_aggregate_id"`
	Status           *string    `db:"status"`
	CreatedAt        *time.Time `db:"created_at"`
	StreamID         *string    `db:"stream_id"`
	PartitionKey     *string    `db:"partition_key"`
}

// Run reconciles and reports; it returns an error only when it could not
// read what it needs.
func Run(ctx context.Context, pool *pgxpool.Pool, rdb redis.Cmdable, opt Options) (Report, error) {
	if opt.Now.IsZero() {
		opt.Now = time.Now()
	}
	if opt.Grace <= 0 {
		opt.Grace = DefaultGrace
	}
	if opt.Since.IsZero() {
		opt.Since = opt.Now.Add(-DefaultSince)
	}
	if opt.Retention <= 0 {
		opt.Retention = fraud.DefaultRetention
	}
	opt.Partitions = max(opt.Partitions, 1)
	keys := fraud.Keys{Prefix: opt.KeyPrefix, Partitions: opt.Partitions}
	rep := Report{Since: opt.Since, Grace: opt.Grace.String(), SenderDiffs: []SenderDiff{}}
	for _, d := range []*Diff{&rep.MissingEvent, &rep.Orphan, &rep.Unpublished, &rep.NoVerdict, &rep.NotInStream} {
		d.Examples = []string{} // [] in JSON, not null
	}
	cutoff := opt.Now.Add(-opt.Grace)
	senders := map[string]bool{}

	var pending []row // published and past the grace period: verdict to check
	check := func() error {
		if len(pending) == 0 {
			return nil
		}
		err := checkVerdicts(ctx, rdb, keys, opt.Stream, pending, &rep, opt.ListLost)
		pending = pending[:0]
		return err
	}
	var posted []row // published and past the grace period: postings to check
	if opt.Ledger != nil {
		rep.Ledger = newLedgerReport()
	}
	checkPosted := func() error {
		if len(posted) == 0 {
			return nil
		}
		err := checkLedger(ctx, opt.Ledger, posted, rep.Ledger)
		posted = posted[:0]
		return err
	}
	hq := queries.ReconcileCleanupHorizon()
	if err := pool.QueryRow(ctx, hq.SQL, hq.Args...).Scan(&rep.CleanupHorizon); err != nil {
		return rep, fmt.Errorf("read the cleanup horizon: %w", err)
	}
	// Transfers without their event, settled before the cleanup horizon:
	// judged, their event was cleaned up; not judged, it is missing.
	var cleaned []row
	checkCleaned := func() error {
		if len(cleaned) == 0 {
			return nil
		}
		err := checkCleanedUp(ctx, rdb, keys, cleaned, &rep)
		cleaned = cleaned[:0]
		return err
	}
	q := queries.ReconcileEvents(opt.Since)
	rows, err := pool.Query(ctx, q.SQL, q.Args...)
	if err != nil {
		return rep, fmt.Errorf("read transfers and events: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		r, err := pgx.RowToStructByName[row](rows)
		if err != nil {
			return rep, fmt.Errorf("read transfers and events: %w", err)
		}
		if r.TransferID != nil {
			rep.Transfers++
			senders[*r.FromAccount] = true
		}
		if r.EventID != nil {
			rep.Events++
		}
		switch {
		case r.EventID == nil && rep.CleanupHorizon != nil && r.SettledAt.Before(*rep.CleanupHorizon):
			if fraud.DayExpiry(*r.SettledAt, opt.Retention).Before(opt.Now.Add(expiryMargin)) {
				rep.CleanedUp++ // nothing left to tell a cleaned-up event from a missing one
				continue
			}
			if cleaned = append(cleaned, r); len(cleaned) == batch {
				if err := checkCleaned(); err != nil {
					return rep, err
				}
			}
		case r.EventID == nil:
			rep.MissingEvent.add(*r.TransferID)
		case r.TransferID == nil:
			rep.Orphan.add(*r.EventID)
		case r.CreatedAt.After(cutoff):
			// Young: may still be on its way.
		case *r.Status != "published":
			rep.Unpublished.add(*r.EventID)
		default:
			if opt.Ledger != nil {
				if posted = append(posted, r); len(posted) == batch {
					if err := checkPosted(); err != nil {
						return rep, err
					}
				}
			}
			if fraud.DayExpiry(*r.SettledAt, opt.Retention).Before(opt.Now.Add(expiryMargin)) {
				// Its verdict has expired, or may while this runs.
				rep.PastRetention++
				continue
			}
			if pending = append(pending, r); len(pending) == batch {
				if err := check(); err != nil {
					return rep, err
				}
			}
		}
	}
	if err := rows.Err(); err != nil {
		return rep, fmt.Errorf("read transfers and events: %w", err)
	}
	if err := check(); err != nil {
		return rep, err
	}
	if err := checkPosted(); err != nil {
		return rep, err
	}
	if err := checkCleaned(); err != nil {
		return rep, err
	}

	list := make([]string, 0, len(senders))
	for s := range senders {
		list = append(list, s)
	}
	slices.Sort(list)
	rep.Senders = len(list)
	for chunk := range slices.Chunk(list, senderBatch) {
		diffs, err := checkTotals(ctx, pool, rdb, keys, chunk)
		if err != nil {
			return rep, err
		}
		rep.TotalsDiffer += len(diffs)
		for _, d := range diffs {
			if len(rep.SenderDiffs) < examples {
				rep.SenderDiffs = append(rep.SenderDiffs, d)
			}
		}
	}
	rep.OK = rep.MissingEvent.Count == 0 && rep.Orphan.Count == 0 && rep.Unpublished.Count == 0 &&
		rep.NoVerdict.Count == 0 && rep.NotInStream.Count == 0 && rep.TotalsDiffer == 0 && rep.Ledger.ok()
	return rep, nil
}

// verdictsOf reads anti-fraud's verdicts of the transfers of rs ("": none).
func verdictsOf(ctx context.Context, rdb redis.Cmdable, keys fraud.Keys, rs []row) ([]string, error) {
	ids := make([]string, len(rs))
	senders := make([]string, len(rs))
	for i, r := range rs {
		ids[i], senders[i] = *r.TransferID, *r.FromAccount
	}
	return fraud.ReadVerdictsOf(ctx, rdb, keys, ids, senders)
}

// checkCleanedUp looks up the verdicts of transfers settled before the
// cleanup horizon whose event is gone: a verdict says the event was
// published and judged, then cleaned up; none, that it is missing.
func checkCleanedUp(ctx context.Context, rdb redis.Cmdable, keys fraud.Keys, rs []row, rep *Report) error {
	vals, err := verdictsOf(ctx, rdb, keys, rs)
	if err != nil {
		return err
	}
	for i, v := range vals {
		if v != "" {
			rep.CleanedUp++
		} else {
			rep.MissingEvent.add(*rs[i].TransferID)
		}
	}
	return nil
}

// checkVerdicts looks up the verdicts of published events' transfers, and
// for those without one, whether their stream entry is still there.
func checkVerdicts(ctx context.Context, rdb redis.Cmdable, keys fraud.Keys, stream string, rs []row, rep *Report, listLost bool) error {
	vals, err := verdictsOf(ctx, rdb, keys, rs)
	if err != nil {
		return err
	}
	var missing []row
	for i, v := range vals {
		if v == "" {
			missing = append(missing, rs[i])
		}
	}
	if len(missing) == 0 {
		return nil
	}
	n := max(keys.Partitions, 1)
	cmds := make([]*redis.XMessageSliceCmd, len(missing))
	_, err = rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, r := range missing {
			id := "0-0"
			if r.StreamID != nil && *r.StreamID != "" {
				id = *r.StreamID
			}
			key := *r.FromAccount
			if r.PartitionKey != nil {
				key = *r.PartitionKey
			}
			cmds[i] = p.XRange(ctx, partition.Stream(stream, partition.Of(key, n), n), id, id)
		}
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("read stream %s: %w", stream, err)
	}
	for i, r := range missing {
		if msgs, _ := cmds[i].Result(); len(msgs) > 0 {
			rep.NoVerdict.add(*r.EventID)
		} else {
			rep.NotInStream.add(*r.EventID)
			if listLost {
				rep.Lost = append(rep.Lost, *r.EventID)
			}
		}
	}
	return nil
}

// checkTotals compares each sender's anti-fraud totals, summed over the
// retained days, with the sums over the sender's transfers that have a
// verdict key, both read from Redis in one MULTI so that no effect lands
// between them. (A verdict found only in the hash of older versions counted
// in totals that are no longer read: it is left out on both sides.) A sender
// that differs is read again, up to totalsTries times: a transfer committed
// after the SQL read and judged before the Redis read differs once, not
// three times.
func checkTotals(ctx context.Context, pool *pgxpool.Pool, rdb redis.Cmdable, keys fraud.Keys, senders []string) ([]SenderDiff, error) {
	var diffs []SenderDiff
	for try := 1; len(senders) > 0 && try <= totalsTries; try++ {
		diffs = diffs[:0]
		byAccount := map[string][]transferAmount{}
		q := queries.ReconcileSenderTransfers(senders)
		rows, err := pool.Query(ctx, q.SQL, q.Args...)
		if err != nil {
			return nil, fmt.Errorf("read senders' transfers: %w", err)
		}
		for rows.Next() {
			var acct string
			var t transferAmount
			if err := rows.Scan(&acct, &t.id, &t.cents); err != nil {
				rows.Close()
				return nil, fmt.Errorf("read senders' transfers: %w", err)
			}
			byAccount[acct] = append(byAccount[acct], t)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return nil, fmt.Errorf("read senders' transfers: %w", err)
		}
		var days []string
		for _, k := range keys.Each() {
			ds, err := rdb.ZRange(ctx, k.Days(), 0, -1).Result()
			if err != nil {
				return nil, fmt.Errorf("read anti-fraud's days: %w", err)
			}
			for _, d := range ds {
				if !slices.Contains(days, d) {
					days = append(days, d)
				}
			}
		}
		verdicts := map[string]*redis.SliceCmd{}
		totals := map[string][]*redis.SliceCmd{}
		for _, group := range byPartition(senders, max(keys.Partitions, 1)) {
			_, err = rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
				for _, acct := range group {
					ks := keys.Sender(acct)
					ids := make([]string, len(byAccount[acct]))
					for i, t := range byAccount[acct] {
						ids[i] = ks.Verdict(t.id)
					}
					if len(ids) > 0 {
						verdicts[acct] = p.MGet(ctx, ids...)
					}
					for _, day := range days {
						totals[acct] = append(totals[acct], p.HMGet(ctx, ks.DayAccount(day, acct), "sent_cents", "transfers"))
					}
				}
				return nil
			})
			if err != nil {
				return nil, fmt.Errorf("read anti-fraud totals: %w", err)
			}
		}
		var again []string
		for _, acct := range senders {
			d := SenderDiff{Account: acct}
			if vc := verdicts[acct]; vc != nil {
				for i, v := range vc.Val() {
					if v != nil {
						d.WantCents += byAccount[acct][i].cents
						d.WantTransfers++
					}
				}
			}
			for _, tc := range totals[acct] {
				tv := tc.Val()
				d.FraudCents += toInt(tv[0])
				d.FraudTransfers += toInt(tv[1])
			}
			if d.FraudCents != d.WantCents || d.FraudTransfers != d.WantTransfers {
				diffs = append(diffs, d)
				again = append(again, acct)
			}
		}
		senders = again
	}
	return diffs, nil
}

// byPartition groups senders by their partition, in partition order: a
// sender's verdicts and totals live in its partition's slot, and a MULTI on a
// Redis Cluster may not span slots.
func byPartition(senders []string, n int) [][]string {
	groups := make([][]string, n)
	for _, s := range senders {
		p := partition.Of(s, n)
		groups[p] = append(groups[p], s)
	}
	return slices.DeleteFunc(groups, func(g []string) bool { return len(g) == 0 })
}

type transferAmount struct {
	id    string
	cents int64
}

func toInt(v any) int64 {
	s, _ := v.(string)
	n, _ := strconv.ParseInt(s, 10, 64)
	return n
}
