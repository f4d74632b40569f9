package chaos

import (
	"bufio"
	"bytes"
	"sort"
	"strconv"
	"strings"
	"time"
)

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
		case evReestablished: // a reconnection that took more than one try
			msg = evListening
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

func concatImpaired(tls []relayTimeline) []span {
	var out []span
	for _, tl := range tls {
		out = append(out, tl.impaired...)
	}
	return out
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
