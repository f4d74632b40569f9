package chaos

// Stranded events: committed, not lost, but published seconds late.
//
// The relays are woken by a NOTIFY that writers send only while some relay
// says it is asleep (sql/migrations/0006_outbox_notify_idle.sql). A defect in
// that protocol loses nothing, since the relay's fallback poll finds the row,
// but leaves the event waiting for that poll (relay.DefaultPollInterval, 5s)
// instead of being published within milliseconds. The lost/doubled checks
// cannot see that; this analysis can, because the suite runs the relays at the
// default poll.
//
// Definition, per published transfer.settled event:
//
//   - commit is when the settle transaction committed:
//     pg_xact_commit_timestamp of the xmin of its transfers row (written in
//     the same transaction as the event and never updated;
//     track_commit_timestamp is on in the suite's PostgreSQL). If that is not
//     available, outbox_messages.created_at, the transaction's start, which
//     is earlier by the length of the transaction.
//   - publish is the millisecond part of the id of the first entry in the
//     stream that carries the event id: when the event first reached Redis.
//     outbox_messages.stream_id is the last XADD whose mark was accepted (a
//     crashed relay's event is published again), and published_at is when
//     the mark was written, which rides the next claim; neither is used.
//     Both clocks are this machine's.
//   - The event is judged only if it committed in a calm phase: no fault
//     window (below) intersects [commit-calmBefore, commit+strandedAfter]
//     (after a busy error, busyErrorSettle instead of calmBefore).
//     The 2s before let what the windows do not model settle (a pool
//     redialling, a backlog draining); the 1s after is the whole time the
//     event had to be published in, so all of it is calm.
//   - A judged event with publish-commit > strandedAfter (1s) is stranded.
//
// Fault windows. A fault is active from its Start until the relays' wake-up
// path is back (FaultRecord.Back): the first instant at or after its End at
// which no relay is impaired, where a relay is impaired (relayTimeline)
//
//   - while it is not running (a killed relay until the supervisor restarted
//     it) and from each start until its LISTEN is up (log "listening"): a
//     SIGKILLed relay that was draining leaves writers silent, and that lasts
//     until a relay re-asserts "asleep", so a kill's window lasts at least
//     until the replacement is up;
//   - from a lost LISTEN connection (logged) until it is up again;
//   - while it backs off from Redis (log "redis unavailable; backing off",
//     retry_in), and, if the error was a timeout, while the publish hung
//     before (publishHang);
//   - while it waits to retry a failed drain (log "drain failed; retrying",
//     retry_in), and, if the error was a timeout, while the statement hung
//     before (statementHang);
//   - for faults that cut PostgreSQL connections (pg-terminate, pg-restart,
//     a blackhole of PostgreSQL), from the fault's Start until the relay logs
//     a LISTEN established at or after the fault's End: a blackholed LISTEN
//     connection is half-open and the relay only finds out by pinging it
//     after listenPingEvery quiet polls, seconds after the fault ended.
//
// Recovery (FaultRecord.Recovery, until every TED committed before End has a
// verdict) is not used: it measures the consumers and the backlog too, and
// counting it would hide the calm phases in which the wake-up path is back
// while the backlog drains. Impairments only extend a fault's window from its
// End; they never open a window by themselves, so a relay that misbehaves in a
// calm phase is judged, not excused. The window is capped at backLimit after
// End: a relay whose LISTEN never comes back must show up as stranded events,
// not hide them.

import (
	"context"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/tedbank/outbox/relay"
)

const (
	// strandedAfter: a calm-phase event published later than this after its
	// commit is stranded. A woken relay publishes within milliseconds.
	strandedAfter = time.Second
	// calmBefore: how long before its commit an event's phase must be free of
	// faults for it to be judged.
	calmBefore = 2 * time.Second
	// busyErrorSettle replaces calmBefore after a busy error (settleAfter):
	// none. Its window ends when the failed drain's retry starts, and that
	// drain claims every row committed before.
	busyErrorSettle = 0
	// strandedExamples: how many stranded events are described in detail;
	// strandedGroups: for how many preceding faults the stranded events
	// after each are summed up.
	strandedExamples = 5
	strandedGroups   = 10
)

// The relay's own timings that bound its impairments (relay/relay.go,
// relay/listen.go), as the suite runs it (relayArgs: --lease 5s, the default
// poll).
const (
	relayPoll = relay.DefaultPollInterval
	// publishHang is the relay's publish timeout: min(5s, lease/2).
	publishHang = 2500 * time.Millisecond
	// statementHang is the relay's claimTimeout, its longest statement.
	statementHang = 10 * time.Second
	// The LISTEN connection is pinged after listenPingEvery quiet polls,
	// with listenPingTimeout; reconnects back off up to listenBackoffMax.
	listenPingEvery   = 4
	listenPingTimeout = 5 * time.Second
	listenBackoffMax  = 30 * time.Second
	// backLimit caps a fault's window after its End: a half-open LISTEN
	// connection is found within listenPingEvery+1 polls plus the ping
	// timeout, and is back after at most the longest reconnect backoff.
	backLimit = (listenPingEvery+1)*relayPoll + listenPingTimeout + listenBackoffMax
)

// forever stands for "until the end of the run".
var forever = time.Date(9999, 1, 1, 0, 0, 0, 0, time.UTC)

// span is the time interval [from, to).
type span struct{ from, to time.Time }

func (s span) contains(t time.Time) bool { return !t.Before(s.from) && t.Before(s.to) }

// backTime returns the first instant at or after end that no span in
// impaired contains, capped at end+limit (capped then reports true).
func backTime(end time.Time, impaired []span, limit time.Duration) (back time.Time, capped bool) {
	back = end
	for changed := true; changed; {
		changed = false
		for _, s := range impaired {
			if s.contains(back) {
				back, changed = s.to, true
			}
		}
	}
	if lim := end.Add(limit); back.After(lim) {
		return lim, true
	}
	return back, false
}

// cutsPostgres reports whether a fault cuts the relays' PostgreSQL
// connections, their LISTEN connection included.
func cutsPostgres(f FaultRecord) bool {
	switch f.Kind {
	case PGTerminate, PGRestart:
		return true
	case Blackhole:
		return strings.Contains(f.Detail, "pg")
	}
	return false
}

// Kinds of relay log line the timeline reads.
const (
	evListening = "listening"
	// evReestablished is "listening" after failed tries (relay/listen.go);
	// the analysis reads it as evListening.
	evReestablished = "listen connection re-established"
	evListenLost    = "listen connection lost; reconnecting"
	evBackoff       = "redis unavailable; backing off"
	evDrainFailed   = "drain failed; retrying"
)

// eventTiming is one event's commit and first publish.
type eventTiming struct {
	ID               string
	Commit, Publish  time.Time
	CreatedAt        time.Time
	ClaimedBy        string
	Key              string // its partition key (the sender)
	Seq              int64
	CommitFromCreate bool // Commit is created_at: no commit timestamp
	// Ready is when the event could first be claimed: its commit, or, if
	// later, when the event before it of the same partition key (the
	// sender's previous TED) was marked published. The claim's gate holds
	// a key's next event until then (docs/design.md section 2): after a
	// relay dies holding a sender's TED, the sender's next TED waits for
	// the lease, not for a poll.
	Ready time.Time
}

func (e eventTiming) delay() time.Duration { return e.Publish.Sub(maxTime(e.Commit, e.Ready)) }

// strandedReport is what classify found.
type strandedReport struct {
	Judged   int
	Stranded []eventTiming // by commit time
	Worst    eventTiming   // the judged event with the longest delay
	// Margin counts the events not judged although they committed outside
	// every window (within the margins); MarginWorst is the slowest.
	Margin      int
	MarginWorst eventTiming
}

// classify judges the events that committed in calm phases.
func classify(events []eventTiming, windows []window) strandedReport {
	var rep strandedReport
	for _, e := range events {
		if !calm(windows, e.Commit) {
			if !inWindow(windows, e.Commit) {
				if rep.Margin == 0 || e.delay() > rep.MarginWorst.delay() {
					rep.MarginWorst = e
				}
				rep.Margin++
			}
			continue
		}
		if rep.Judged == 0 || e.delay() > rep.Worst.delay() {
			rep.Worst = e
		}
		rep.Judged++
		if e.delay() > strandedAfter {
			rep.Stranded = append(rep.Stranded, e)
		}
	}
	sort.Slice(rep.Stranded, func(i, j int) bool { return rep.Stranded[i].Commit.Before(rep.Stranded[j].Commit) })
	return rep
}

// entryTime returns the millisecond time of a stream entry id <ms>-<n>.
func entryTime(id string) (time.Time, bool) {
	ms, _, ok := strings.Cut(id, "-")
	n, err := strconv.ParseInt(ms, 10, 64)
	if !ok || err != nil {
		return time.Time{}, false
	}
	return time.UnixMilli(n), true
}

// timelines reads every relay's incarnations and log.
func (r *run) timelines() ([]relayTimeline, error) {
	var out []relayTimeline
	for _, p := range r.relays {
		data, err := os.ReadFile(p.logPath)
		if err != nil {
			return nil, err
		}
		events := parseRelayLog(data)
		tl := buildTimeline(p.name, p.incarnations(), events)
		if len(tl.listening) == 0 {
			return nil, fmt.Errorf("%s logged no %q line: the analysis needs the relays' debug logs (relayArgs)", p.name, evListening)
		}
		out = append(out, tl)
	}
	return out, nil
}

// eventTimings reads every published event's commit and first publish.
func (r *run) eventTimings(ctx context.Context) ([]eventTiming, error) {
	var track string
	if err := r.mon.QueryRow(ctx, "SELECT current_setting('track_commit_timestamp')").Scan(&track); err != nil {
		return nil, err
	}
	commitTS := "NULL::timestamptz"
	if track == "on" {
		commitTS = "pg_xact_commit_timestamp(t.xmin)"
	}
	rows, err := r.mon.Query(ctx, `SELECT o.id::text, `+commitTS+`, o.created_at, o.stream_id, coalesce(o.claimed_by, ''), o.before_published_at,
		       coalesce(o.partition_key, o.aggregate_id), o.seq
		FROM (SELECT *, lag(published_at) OVER (PARTITION BY aggregate_type, coalesce(partition_key, aggregate_id) ORDER BY seq) AS before_published_at
		        FROM outbox_messages WHERE aggregate_type = 'transfer' AND status IN ('published', 'dead')) o
		JOIN transfers t ON t.id::text = o.aggregate_id
		WHERE o.event_type = 'transfer.settled' AND o.status = 'published'`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []eventTiming
	for rows.Next() {
		var (
			e        eventTiming
			commit   *time.Time
			streamID *string
			before   *time.Time
		)
		if err := rows.Scan(&e.ID, &commit, &e.CreatedAt, &streamID, &e.ClaimedBy, &before, &e.Key, &e.Seq); err != nil {
			return nil, err
		}
		e.Commit = e.CreatedAt
		if commit != nil {
			e.Commit = *commit
		} else {
			e.CommitFromCreate = true
		}
		e.Ready = e.Commit
		if before != nil && before.After(e.Ready) {
			e.Ready = *before
		}
		id := r.firstEntry[e.ID]
		if id == "" && streamID != nil {
			id = *streamID
		}
		pub, ok := entryTime(id)
		if !ok {
			continue // not in the stream: verify reports it
		}
		e.Publish = pub
		out = append(out, e)
	}
	return out, rows.Err()
}

// stranded computes every fault's Back, judges the calm-phase events and
// fills res.Stranded, res.Judged and res.WorstCalm.
func (r *run) stranded(ctx context.Context, res *Result) {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	tls, err := r.timelines()
	if err != nil {
		r.problem("stranded analysis: %v", err)
		return
	}
	r.mu.Lock()
	faults := r.faults
	for i := range faults {
		var capped bool
		faults[i].Back, capped = faultBack(faults[i], tls)
		if capped {
			r.logf("fault #%d %s %s: the relays were not back within %s of its end; judging events from then on",
				i+1, faults[i].Kind, faults[i].Detail, backLimit)
		}
	}
	r.mu.Unlock()
	setupBack, _ := backTime(r.loadStart, concatImpaired(tls), backLimit)

	events, err := r.eventTimings(ctx)
	if err != nil {
		r.problem("stranded analysis: read events: %v", err)
		return
	}
	windows := faultWindows(faults, setupBack)
	rep := classify(events, windows)
	r.judgeProbes(events, windows, res)
	r.judgeAfterFaults(events, faults, res)
	res.Judged, res.Stranded = rep.Judged, len(rep.Stranded)
	if rep.Judged > 0 {
		res.WorstCalm = rep.Worst.delay()
	}

	var fromCreate int
	var txMax time.Duration
	for _, e := range events {
		if e.CommitFromCreate {
			fromCreate++
		}
		txMax = max(txMax, e.Commit.Sub(e.CreatedAt))
	}
	var calmTime time.Duration
	if len(events) > 0 {
		first, last := events[0].Commit, events[0].Commit
		for _, e := range events {
			first, last = minTime(first, e.Commit), maxTime(last, e.Commit)
		}
		calmTime = calmDuration(windows, first, last)
	}
	r.detail("stranded: %d of %d events judged (committed in calm phases, %s of calm in the load); %d stranded (published more than %s after commit); worst calm delay %s (event %s); commit time from the commit timestamp (%d from created_at), at most %s after created_at",
		rep.Judged, len(events), calmTime.Round(100*time.Millisecond), len(rep.Stranded), strandedAfter,
		res.WorstCalm.Truncate(time.Millisecond), rep.Worst.ID, fromCreate, txMax.Round(time.Millisecond))
	if rep.Margin > 0 {
		r.detail("stranded: %d events committed outside the fault windows but within their margins were not judged; the slowest took %s (event %s, %s)",
			rep.Margin, rep.MarginWorst.delay().Truncate(time.Millisecond), rep.MarginWorst.ID, nearestFaults(faults, rep.MarginWorst.Commit))
	}
	for i, f := range faults {
		r.logf("fault #%d %s %s: window %s..%s (back %s after its end)", i+1, f.Kind, f.Detail,
			stamp(f.Start), stamp(f.Back), f.Back.Sub(f.End).Round(time.Millisecond))
	}
	if len(rep.Stranded) == 0 {
		return
	}
	var hist [4]int // 1-2s, 2-5s, 5-10s, >10s
	for _, e := range rep.Stranded {
		switch d := e.delay(); {
		case d <= 2*time.Second:
			hist[0]++
		case d <= 5*time.Second:
			hist[1]++
		case d <= 10*time.Second:
			hist[2]++
		default:
			hist[3]++
		}
	}
	r.detail("stranded delays: 1-2s %d, 2-5s %d, 5-10s %d, >10s %d", hist[0], hist[1], hist[2], hist[3])
	// By the fault that preceded them, in order.
	type group struct {
		n           int
		first, last time.Time
		worst       eventTiming
	}
	var order []int
	groups := map[int]*group{}
	for _, e := range rep.Stranded {
		i := faultBefore(faults, e.Commit)
		g := groups[i]
		if g == nil {
			g = &group{first: e.Commit, worst: e}
			groups[i] = g
			order = append(order, i)
		}
		g.n++
		g.last = e.Commit
		if e.delay() > g.worst.delay() {
			g.worst = e
		}
	}
	for _, i := range order[:min(strandedGroups, len(order))] {
		g, what := groups[i], "before any fault"
		if i >= 0 {
			f := faults[i]
			what = fmt.Sprintf("after fault #%d %s %s (back at %s)", i+1, f.Kind, f.Detail, stamp(f.Back))
		}
		r.detail("stranded %s: %d events committed %s..%s, worst %s (event %s)", what, g.n, stamp(g.first), stamp(g.last),
			g.worst.delay().Truncate(time.Millisecond), g.worst.ID)
	}
	for _, e := range rep.Stranded[:min(strandedExamples, len(rep.Stranded))] {
		r.detail("stranded event %s: committed %s, published %s (%s later) by %s; %s", e.ID, stamp(e.Commit), stamp(e.Publish),
			e.delay().Round(time.Millisecond), e.ClaimedBy, nearestFaults(faults, e.Commit))
	}
	r.problem("%d events stranded: committed in a calm phase but published more than %s later (worst %s); see the details",
		len(rep.Stranded), strandedAfter, res.WorstCalm.Truncate(time.Millisecond))
}
