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
	"bufio"
	"bytes"
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

// relayTimeline is what one relay's log and incarnations say about its
// wake-up path.
type relayTimeline struct {
	name      string
	impaired  []span      // see the package comment above
	listening []time.Time // every LISTEN established, in order
}

// listenAfter returns the first LISTEN established at or after t, or forever.
func (tl relayTimeline) listenAfter(t time.Time) time.Time {
	i := sort.Search(len(tl.listening), func(i int) bool { return !tl.listening[i].Before(t) })
	if i == len(tl.listening) {
		return forever
	}
	return tl.listening[i]
}

// faultBack returns when the wake-up path was back after f: see the package
// comment. capped: not within backLimit.
func faultBack(f FaultRecord, relays []relayTimeline) (time.Time, bool) {
	var impaired []span
	for _, tl := range relays {
		impaired = append(impaired, tl.impaired...)
		if cutsPostgres(f) {
			impaired = append(impaired, span{f.Start, tl.listenAfter(f.End)})
		}
	}
	return backTime(f.End, impaired, backLimit)
}

// Kinds of relay log line the timeline reads.
const (
	evListening   = "listening"
	evListenLost  = "listen connection lost; reconnecting"
	evBackoff     = "redis unavailable; backing off"
	evDrainFailed = "drain failed; retrying"
)

// logEvent is one relay log line the timeline uses.
type logEvent struct {
	at      time.Time
	msg     string
	retryIn time.Duration
	hung    bool // the error was a timeout: the failed call hung until then
}

// parseRelayLog reads a relay's log (the text handler's lines, and the
// supervisor's "=== chaos: start NAME #N" lines between incarnations) into
// the events of each incarnation, by incarnation number.
func parseRelayLog(data []byte) map[int][]logEvent {
	out := map[int][]logEvent{}
	cur := 0
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for sc.Scan() {
		line := sc.Text()
		if rest, ok := strings.CutPrefix(line, "=== chaos: start "); ok {
			if _, num, ok := strings.Cut(rest, " #"); ok {
				num, _, _ = strings.Cut(num, " ")
				if n, err := strconv.Atoi(num); err == nil {
					cur = n
				}
			}
			continue
		}
		rest, ok := strings.CutPrefix(line, "time=")
		if !ok {
			continue
		}
		ts, _, _ := strings.Cut(rest, " ")
		at, err := time.Parse(time.RFC3339Nano, ts)
		if err != nil {
			continue
		}
		msg := field(line, "msg")
		switch msg {
		case evListening, evListenLost, evBackoff, evDrainFailed:
		default:
			continue
		}
		ev := logEvent{at: at, msg: msg}
		if v := field(line, "retry_in"); v != "" {
			ev.retryIn, _ = time.ParseDuration(v)
		}
		if e := field(line, "error"); strings.Contains(e, "timeout") || strings.Contains(e, "deadline exceeded") {
			ev.hung = true
		}
		out[cur] = append(out[cur], ev)
	}
	return out
}

// field returns the value of key=value in a text handler line, unquoted.
func field(line, key string) string {
	i := strings.Index(line, " "+key+"=")
	if i < 0 {
		return ""
	}
	v := line[i+len(key)+2:]
	if strings.HasPrefix(v, `"`) {
		q, err := strconv.QuotedPrefix(v)
		if err != nil {
			return ""
		}
		s, _ := strconv.Unquote(q)
		return s
	}
	v, _, _ = strings.Cut(v, " ")
	return v
}

// buildTimeline turns a relay's incarnations and the events of its log into
// its impairments and LISTENs (see the package comment).
func buildTimeline(name string, incs []incarnation, events map[int][]logEvent) relayTimeline {
	tl := relayTimeline{name: name}
	for i, inc := range incs {
		end := inc.end
		if end.IsZero() {
			end = forever
		}
		// Not running between this incarnation and the next. (After the
		// last one the suite stopped the relay: the run is over.)
		if !inc.end.IsZero() && i+1 < len(incs) {
			tl.impaired = append(tl.impaired, span{inc.end, incs[i+1].start})
		}
		down := inc.start // LISTEN down since (zero: up)
		for _, ev := range events[i+1] {
			switch ev.msg {
			case evListening:
				if !down.IsZero() {
					tl.impaired = append(tl.impaired, span{down, ev.at})
					down = time.Time{}
				}
				tl.listening = append(tl.listening, ev.at)
			case evListenLost:
				if down.IsZero() {
					down = ev.at
				}
			case evBackoff, evDrainFailed:
				from := ev.at
				if ev.hung && ev.msg == evBackoff {
					from = from.Add(-publishHang)
				} else if ev.hung {
					from = from.Add(-statementHang)
				}
				tl.impaired = append(tl.impaired, span{from, ev.at.Add(ev.retryIn)})
			}
		}
		if !down.IsZero() {
			tl.impaired = append(tl.impaired, span{down, end})
		}
	}
	sort.Slice(tl.listening, func(i, j int) bool { return tl.listening[i].Before(tl.listening[j]) })
	return tl
}

// eventTiming is one event's commit and first publish.
type eventTiming struct {
	ID               string
	Commit, Publish  time.Time
	CreatedAt        time.Time
	ClaimedBy        string
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

// calm reports whether no window intersects [t-calmBefore, t+strandedAfter].
func calm(windows []window, t time.Time) bool {
	hi := t.Add(strandedAfter)
	for _, w := range windows {
		if !w.from.After(hi) && !w.to.Add(w.settle).Before(t) {
			return false
		}
	}
	return true
}

// inWindow reports whether t is in some window.
func inWindow(windows []window, t time.Time) bool {
	for _, w := range windows {
		if !t.Before(w.from) && !t.After(w.to) {
			return true
		}
	}
	return false
}

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

// window is a fault's window; events that commit within settle after it
// are not judged either.
type window struct {
	span
	settle time.Duration
}

// faultWindows returns each fault's window [Start, Back], and before the
// load a window until the relays were back at loadStart.
func faultWindows(faults []FaultRecord, setupBack time.Time) []window {
	ws := []window{{span{time.Time{}, setupBack}, calmBefore}}
	for _, f := range faults {
		ws = append(ws, window{span{f.Start, f.Back}, settleAfter(f.Kind)})
	}
	return ws
}

// settleAfter is how long after a fault's window events are still not
// judged: calmBefore, for what the windows do not model (a pool redialling,
// a backlog draining), except after a busy error, which cuts no connection
// and whose one after-effect, the failed drain's retry, is in the window
// (Back): its backlog is the rows committed during the failed round trip.
// A relay that goes to sleep with writers silent after it strands the
// events committed in the next seconds, and they must be judged.
func settleAfter(kind string) time.Duration {
	if kind == BusyError {
		return busyErrorSettle
	}
	return calmBefore
}

// faultBefore returns the index of the fault whose window ended last at or
// before t, or -1.
func faultBefore(faults []FaultRecord, t time.Time) int {
	prev := -1
	for i, f := range faults {
		if !f.Back.After(t) && (prev < 0 || f.Back.After(faults[prev].Back)) {
			prev = i
		}
	}
	return prev
}

// nearestFaults describes the fault whose window ended last before t and the
// first that started after it.
func nearestFaults(faults []FaultRecord, t time.Time) string {
	prev, next := faultBefore(faults, t), -1
	for i, f := range faults {
		if f.Start.After(t) && (next < 0 || f.Start.Before(faults[next].Start)) {
			next = i
		}
	}
	var parts []string
	if prev >= 0 {
		f := faults[prev]
		parts = append(parts, fmt.Sprintf("after fault #%d %s %s (%s..%s, back %s before the commit)",
			prev+1, f.Kind, f.Detail, stamp(f.Start), stamp(f.Back), t.Sub(f.Back).Round(time.Millisecond)))
	} else {
		parts = append(parts, "no fault before")
	}
	if next >= 0 {
		f := faults[next]
		parts = append(parts, fmt.Sprintf("before fault #%d %s %s (starts %s after the commit)",
			next+1, f.Kind, f.Detail, f.Start.Sub(t).Round(time.Millisecond)))
	} else {
		parts = append(parts, "no fault after")
	}
	return strings.Join(parts, "; ")
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
	rows, err := r.mon.Query(ctx, `SELECT o.id::text, `+commitTS+`, o.created_at, o.stream_id, coalesce(o.claimed_by, ''), o.before_published_at
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
		if err := rows.Scan(&e.ID, &commit, &e.CreatedAt, &streamID, &e.ClaimedBy, &before); err != nil {
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

func concatImpaired(tls []relayTimeline) []span {
	var out []span
	for _, tl := range tls {
		out = append(out, tl.impaired...)
	}
	return out
}

// calmDuration is how much of [from, to] is outside every window, give or
// take the margins of calm: the time in which a commit would be judged.
func calmDuration(windows []window, from, to time.Time) time.Duration {
	// Widen each window by the margins, then measure what is left.
	ws := make([]span, 0, len(windows))
	for _, w := range windows {
		ws = append(ws, span{w.from.Add(-strandedAfter), w.to.Add(w.settle)})
	}
	sort.Slice(ws, func(i, j int) bool { return ws[i].from.Before(ws[j].from) })
	total, cur := time.Duration(0), from
	for _, w := range ws {
		if !w.from.After(cur) {
			cur = maxTime(cur, w.to)
			continue
		}
		if w.from.After(to) {
			break
		}
		total += w.from.Sub(cur)
		cur = maxTime(cur, w.to)
	}
	if to.After(cur) {
		total += to.Sub(cur)
	}
	return total
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
