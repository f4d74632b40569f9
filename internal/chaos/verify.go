package chaos

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/connect"
	"github.com/tedbank/outbox/partition"
)

const (
	stream    = fraud.DefaultStream
	group     = fraud.DefaultGroup
	keyPrefix = fraud.DefaultKeyPrefix
)

// fraudKeys names anti-fraud's keys, in every partition.
func (r *run) fraudKeys() fraud.Keys { return fraud.Keys{Prefix: keyPrefix, Partitions: r.parts} }

const (
	// drainLimit bounds the wait for the pipeline to drain after the load.
	drainLimit = 3 * time.Minute
)

// drainState is what waitDrain watches.
type drainState struct {
	transfers, verdicts, pending, publishing, dead int
	ledgered                                       int // TEDs the ledger posted
	groupPending                                   int64
	delivered                                      bool // the group has been delivered the stream's last entry
}

func (s drainState) done() bool {
	return s.pending == 0 && s.publishing == 0 && s.verdicts+s.dead >= s.transfers && s.groupPending == 0 && s.delivered &&
		s.ledgered+s.dead >= s.transfers
}

func (r *run) drainState(ctx context.Context) (drainState, error) {
	var s drainState
	var err error
	if s.transfers, err = r.committed(ctx); err != nil {
		return s, err
	}
	if s.pending, s.publishing, _, s.dead, err = r.outboxCounts(ctx); err != nil {
		return s, err
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if s.verdicts, err = r.verdictCount(ctx); err != nil {
		return s, err
	}
	if s.ledgered, err = r.ledgerCount(ctx); err != nil {
		return s, err
	}
	if r.cfg.NATS {
		s.groupPending, s.delivered, err = r.natsGroup(ctx)
		return s, err
	}
	s.delivered = true
	for _, stream := range partition.Streams(stream, r.parts) {
		pend, err := r.rdb.XPending(ctx, stream, group).Result()
		if err != nil {
			return s, err
		}
		s.groupPending += pend.Count
		info, err := r.rdb.XInfoStream(ctx, stream).Result()
		if err != nil {
			return s, err
		}
		groups, err := r.rdb.XInfoGroups(ctx, stream).Result()
		if err != nil {
			return s, err
		}
		delivered := false
		for _, g := range groups {
			if g.Name == group {
				delivered = g.LastDeliveredID == info.LastGeneratedID
			}
		}
		s.delivered = s.delivered && delivered
	}
	return s, nil
}

// waitDrain waits until everything committed is published and judged and
// the group has nothing pending.
func (r *run) waitDrain(ctx context.Context) {
	start := time.Now()
	limit := drainLimit
	if r.stuck {
		limit = 20 * time.Second
	}
	var last drainState
	var lastErr error
	for time.Since(start) < limit && ctx.Err() == nil {
		s, err := r.drainState(ctx)
		last, lastErr = s, err
		if err == nil && s.done() {
			r.logf("drained %s after the load: %d transfers, %d verdicts", time.Since(start).Round(10*time.Millisecond), s.transfers, s.verdicts)
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
	r.problem("not drained %s after the load: %+v (last error %v)", limit, last, lastErr)
}

// verify checks the end state against PostgreSQL, the source of truth.
func (r *run) verify(ctx context.Context, res *Result) {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	teds := map[string]ted{}
	rows, err := r.mon.Query(ctx, "SELECT id::text, from_account, amount_cents, settled_at FROM transfers")
	if err != nil {
		r.problem("read transfers: %v", err)
		return
	}
	for rows.Next() {
		var id string
		var t ted
		if err := rows.Scan(&id, &t.from, &t.amount, &t.at); err != nil {
			r.problem("read transfers: %v", err)
			return
		}
		teds[id] = t
	}
	rows.Close()
	res.Transfers = len(teds)
	if len(teds) != r.cfg.N {
		r.problem("%d transfers committed, want %d", len(teds), r.cfg.N)
	}

	// Events: exactly one transfer.settled per transfer, all published.
	eventsOf := map[string][]string{} // transfer id -> event ids
	eventIDs := map[string]bool{}
	status := map[string]int{}
	rows, err = r.mon.Query(ctx, `SELECT id::text, aggregate_id, status FROM outbox_messages
		WHERE aggregate_type = 'transfer' AND event_type = 'transfer.settled'`)
	if err != nil {
		r.problem("read events: %v", err)
		return
	}
	for rows.Next() {
		var id, agg, st string
		if err := rows.Scan(&id, &agg, &st); err != nil {
			r.problem("read events: %v", err)
			return
		}
		eventsOf[agg] = append(eventsOf[agg], id)
		eventIDs[id] = true
		status[st]++
	}
	rows.Close()
	res.Events = len(eventIDs)
	var other, blobs, blobsPublished int
	if err := r.mon.QueryRow(ctx, `SELECT count(*) FROM outbox_messages
		WHERE NOT (aggregate_type = 'transfer' AND event_type = 'transfer.settled') AND aggregate_type <> $1`, blobAggregate).Scan(&other); err != nil {
		r.problem("count other events: %v", err)
	}
	// The big payloads (datafaults.go): each published.
	if err := r.mon.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE status = 'published') FROM outbox_messages
		WHERE aggregate_type = $1`, blobAggregate).Scan(&blobs, &blobsPublished); err != nil {
		r.problem("count the big payloads: %v", err)
	}
	if blobs != r.blobBursts*blobCount || blobsPublished != blobs {
		r.problem("big payloads: %d published of %d, want %d", blobsPublished, blobs, r.blobBursts*blobCount)
	}
	noEvent, multiEvent, orphans := 0, 0, 0
	for id := range teds {
		switch n := len(eventsOf[id]); {
		case n == 0:
			noEvent++
		case n > 1:
			multiEvent++
		}
	}
	for agg := range eventsOf {
		if _, ok := teds[agg]; !ok {
			orphans++
		}
	}
	unpublished := len(eventIDs) - status["published"]
	for what, n := range map[string]int{
		"transfers without an event": noEvent, "transfers with more than one event": multiEvent,
		"events without a transfer": orphans, "events not published": unpublished, "events of other types": other,
	} {
		if n > 0 {
			r.problem("%d %s (statuses %v)", n, what, status)
		}
	}

	// The stream: every event is in it (duplicates allowed: at least once).
	inStream := map[string]int{}
	entries := 0
	if r.cfg.NATS {
		if inStream, entries, err = r.natsEntries(ctx); err != nil {
			r.problem("read the JetStream stream: %v", err)
			return
		}
	}
	for _, stream := range partition.Streams(stream, r.parts) {
		if r.cfg.NATS {
			break
		}
		start := "-"
		for {
			msgs, err := r.rdb.XRangeN(ctx, stream, start, "+", 1000).Result()
			if err != nil {
				r.problem("read stream: %v", err)
				return
			}
			for _, m := range msgs {
				id, _ := m.Values["event_id"].(string)
				inStream[id]++
				if _, ok := r.firstEntry[id]; !ok {
					r.firstEntry[id] = m.ID // XRANGE is in id order, and an event has one partition
				}
				entries++
			}
			if len(msgs) < 1000 {
				break
			}
			start = "(" + msgs[len(msgs)-1].ID
		}
	}
	// A JetStream stream holds every aggregate's subjects: the big
	// payloads' events (datafaults.go) are there too, checked above.
	if r.cfg.NATS && r.blobBursts > 0 {
		rows, err := r.mon.Query(ctx, "SELECT id::text FROM outbox_messages WHERE aggregate_type = $1", blobAggregate)
		if err != nil {
			r.problem("read the big payloads' ids: %v", err)
			return
		}
		for rows.Next() {
			var id string
			if err := rows.Scan(&id); err != nil {
				r.problem("read the big payloads' ids: %v", err)
				return
			}
			if inStream[id] > 0 {
				entries -= inStream[id]
				delete(inStream, id)
			}
		}
		rows.Close()
	}
	missing, foreign := 0, 0
	var missingIDs []string
	for id := range eventIDs {
		if inStream[id] == 0 {
			missing++
			missingIDs = append(missingIDs, id)
		}
	}
	for id := range inStream {
		if !eventIDs[id] {
			foreign++
		}
	}
	if missing > 0 {
		r.problem("%d events marked published are not in the stream %s: %s", missing, stream, r.describeEvents(ctx, missingIDs))
	}
	if foreign > 0 {
		r.problem("%d event ids in the stream are not in outbox_messages", foreign)
	}
	res.StreamEntries, res.DuplicatesInRed = entries, entries-len(inStream)

	// Anti-fraud: one verdict per transfer, effects applied once.
	verdicts, err := r.verdicts(ctx)
	if err != nil {
		r.problem("read verdicts: %v", err)
		return
	}
	res.Verdicts = len(verdicts)
	lost, phantom, reviews := 0, 0, 0
	for id := range teds {
		if _, ok := verdicts[id]; !ok {
			lost++
		}
	}
	for id, v := range verdicts {
		if _, ok := teds[id]; !ok {
			phantom++
		}
		if v == "review" {
			reviews++
		}
	}
	rep, err := fraud.ReadReport(ctx, r.rdb, r.fraudKeys())
	if err != nil {
		r.problem("read fraud report: %v", err)
		return
	}
	doubled := max(0, int(rep.Verdicts)-len(verdicts)) + multiEvent
	var alerts []redis.XMessage
	for _, k := range r.fraudKeys().Each() {
		as, err := r.rdb.XRange(ctx, k.Alerts(), "-", "+").Result()
		if err != nil {
			r.problem("read alerts: %v", err)
		}
		alerts = append(alerts, as...)
	}
	alertsOf := map[string]int{}
	for _, a := range alerts {
		id, _ := a.Values["transfer_id"].(string)
		alertsOf[id]++
	}
	doubledAlerts := len(alerts) - len(alertsOf)
	doubled += doubledAlerts
	res.Lost, res.Doubled = lost, doubled
	if lost > 0 {
		r.problem("%d transfers have no verdict (lost)", lost)
	}
	if phantom > 0 {
		r.problem("%d verdicts for transfers that are not in PostgreSQL", phantom)
	}
	if differ, example := verdictsDiffer(teds, verdicts); differ > 0 {
		r.problem("%d verdicts differ from the velocity rule applied offline in settled order (e.g. transfer %s)", differ, example)
	}
	if int(rep.Verdicts) != len(verdicts) {
		r.problem("anti-fraud counted %d effects for %d verdicted transfers", rep.Verdicts, len(verdicts))
	}
	if doubledAlerts > 0 {
		r.problem("%d review alerts written more than once", doubledAlerts)
	}
	if int(rep.Reviews) != reviews || len(alertsOf) != reviews {
		r.problem("reviews: counter %d, review verdicts %d, alerted transfers %d", rep.Reviews, reviews, len(alertsOf))
	}

	// Each sender's totals equal the sums over transfers.
	type totals struct{ cents, n int64 }
	want := map[string]totals{}
	for _, t := range teds {
		w := want[t.from]
		w.cents += t.amount
		w.n++
		want[t.from] = w
	}
	mismatched := 0
	for acct, w := range want {
		got := rep.Accounts[acct]
		if got.SentCents != w.cents || got.Transfers != w.n {
			mismatched++
			if mismatched <= 5 {
				r.detail("account %s: anti-fraud has %d cents in %d transfers, PostgreSQL %d cents in %d", acct, got.SentCents, got.Transfers, w.cents, w.n)
			}
		}
	}
	for acct := range rep.Accounts {
		if _, ok := want[acct]; !ok {
			mismatched++
		}
	}
	if mismatched > 0 {
		r.problem("%d accounts' anti-fraud totals differ from the sums over transfers", mismatched)
	}

	res.OutOfOrder = r.checkOrder(ctx, len(verdicts))

	// Nothing left pending or dead-lettered; every dedupe marker present.
	if r.cfg.NATS {
		if pending, delivered, err := r.natsGroup(ctx); err != nil || pending != 0 || !delivered {
			r.problem("JetStream group %s: %d messages unacknowledged, all delivered %v (err %v)", group, pending, delivered, err)
		}
	}
	for _, stream := range partition.Streams(stream, r.parts) {
		if r.cfg.NATS {
			break
		}
		if pend, err := r.rdb.XPending(ctx, stream, group).Result(); err != nil {
			r.problem("XPENDING: %v", err)
		} else if pend.Count != 0 {
			r.problem("consumer group %s has %d entries pending in %s: %v", group, pend.Count, stream, pend.Consumers)
		}
	}
	markers := 0
	for _, k := range r.fraudKeys().Each() {
		if n, err := r.rdb.XLen(ctx, k.DeadLetters()).Result(); err != nil || n != 0 {
			r.problem("dead-letter stream %s: %d entries (err %v)", k.DeadLetters(), n, err)
		}
		seen, err := connect.Keys(ctx, r.rdb, k.Seen("")+"*")
		if err != nil && err != redis.Nil {
			r.problem("scan dedupe markers: %v", err)
		}
		markers += len(seen)
	}
	if markers != len(eventIDs) {
		r.problem("%d dedupe markers for %d events", markers, len(eventIDs))
	}
	r.detail("stream %s (%d partitions) holds %d entries for %d events (%d duplicates from relay crashes and fencing; anti-fraud skipped %d duplicate deliveries); %d reviews",
		stream, r.parts, entries, len(inStream), entries-len(inStream), rep.DuplicatesSkipped, reviews)
}

// describeEvents says, for up to five events, what PostgreSQL knows of them:
// the stream entry and time it recorded and any republish, so that a failed
// run names what to look for in its logs.
func (r *run) describeEvents(ctx context.Context, ids []string) string {
	slices.Sort(ids)
	ids = ids[:min(len(ids), 5)]
	rows, err := r.mon.Query(ctx, `SELECT m.id::text || ' (seq ' || m.seq || ', key ' || COALESCE(m.partition_key, m.aggregate_id) ||
			', stream id ' || COALESCE(m.stream_id, '-') || ', published ' || COALESCE(to_char(m.published_at, 'HH24:MI:SS.MS'), '-') ||
			', attempts ' || m.attempts || ', republished ' || (SELECT count(*) FROM outbox_republished p WHERE p.event_id = m.id) || ')'
		FROM outbox_messages m WHERE m.id = ANY($1::uuid[]) ORDER BY m.id`, ids)
	if err != nil {
		return fmt.Sprintf("%v (%v)", ids, err)
	}
	described, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Sprintf("%v (%v)", ids, err)
	}
	return strings.Join(described, "; ")
}
