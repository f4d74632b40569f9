package chaos

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/tedbank/outbox/transfer"
)

// Hand-over probes. A relay that stops while it told writers it is busy
// must hand its wake-ups over: writers that read "busy" commit rows that
// announce themselves to nobody, so on its way out it tells writers to
// notify again, waits for those still in their transactions, and sends a
// NOTIFY once they are done (relay.sleepOnExit). During an ordinary deploy
// the other relays usually rescue such rows anyway (a relay that was busy
// too claims them before it sleeps; the next commit's NOTIFY wakes one), so
// a broken hand-over would go unseen. A probe makes the case exact: while
// the relay about to stop is the one that said "busy" and every other relay
// sleeps, the suite settles a TED in a transaction it holds open (its
// trigger read "busy": it will not notify), cuts the burst short so that no
// later commit wakes anyone, stops the relay and commits a little later,
// within the relay's wait. Only the hand-over's NOTIFY can then publish the
// TED within a second; without it the TED waits for a poll or for the next
// incarnation, and the stranded analysis (stranded.go) reports it.

// probeCommitAfter is how long after the relay's SIGTERM the held writer
// commits: well inside the relay's wait for such writers (relay exitWait,
// 3s), long after the relay stopped claiming.
const probeCommitAfter = 700 * time.Millisecond

// probeSearch bounds the wait for the state a probe needs in one burst,
// probeSteady is how long that state must hold first, and probeBursts is
// how many bursts a deploy step tries before it stops a relay without a
// probe.
const (
	probeSearch = 1500 * time.Millisecond
	probeSteady = 40 * time.Millisecond
	probeBursts = 3
)

// probe is one held writer.
type probe struct {
	relay     string // the relay stopped while the writer was open
	peers     []*proc
	tx        pgx.Tx
	eventID   string
	opened    time.Time
	committed time.Time
	// ready: when the relay was stopped, it was the only one not asleep
	// and the idle flag still said "busy".
	ready bool
	err   error
}

// probeAccount is the sender of the probes' TEDs.
const probeAccount = "chaos-probe"

// openProbe waits, during a deploy's burst, until one relay of todo says
// "busy" while every other relay sleeps, and settles a TED in a
// transaction it leaves open; then it cuts the burst short. It returns the
// relay to stop and the probe, or the first relay of todo and nil when the
// state did not come (searched: another burst may bring it) or when it did
// not search (the load is too close to its end: the probe's TED counts
// towards cfg.N, and settleLoop must still be able to settle the rest).
func (r *run) openProbe(ctx context.Context, todo []*proc) (_ *proc, _ *probe, searched bool) {
	if n, err := r.committed(ctx); err != nil || r.cfg.N-n <= r.maxPhaseCount()+10 {
		r.logf("probe: none (%d of %d TEDs committed, err %v): the load is about to end", n, r.cfg.N, err)
		return todo[0], nil, false
	}
	var (
		last  *proc
		since time.Time
	)
	for deadline := time.Now().Add(probeSearch); time.Now().Before(deadline) && ctx.Err() == nil; time.Sleep(3 * time.Millisecond) {
		p := r.loneBusy(todo)
		if p == nil || r.idleFlagValue(ctx) != 0 {
			last = nil
			continue
		}
		// A relay logs "asleep" when it goes to sleep, not when a NOTIFY
		// wakes it: one woken by the burst's first commits may still be
		// draining and about to say "busy" too. Wait until the state holds.
		if p != last {
			last, since = p, time.Now()
		}
		if time.Since(since) < probeSteady {
			continue
		}
		pr, held, err := r.holdWriter(ctx, p)
		if err != nil {
			r.logf("probe: %v", err)
			return todo[0], nil, false
		}
		if !held {
			continue // its trigger read "asleep" and notified: a plain TED
		}
		r.cutBurst()
		pr.ready = r.loneBusy([]*proc{p}) == p && r.idleFlagValue(ctx) == 0
		return p, pr, true
	}
	var states []string
	for _, q := range r.relays {
		states = append(states, q.name+" "+q.wakeState())
	}
	r.logf("probe: no relay was the lone busy one for %s within %s (now %s, idle flag %d)",
		probeSteady, probeSearch, strings.Join(states, ", "), r.idleFlagValue(ctx))
	return todo[0], nil, true
}

// loneBusy returns the relay of candidates that is not asleep while every
// other relay sleeps, if there is one.
func (r *run) loneBusy(candidates []*proc) *proc {
	var awake *proc
	for _, p := range r.relays {
		switch p.wakeState() {
		case "asleep":
		case "busy", "sleep-pending":
			if awake != nil {
				return nil
			}
			awake = p
		default:
			return nil
		}
	}
	for _, c := range candidates {
		if c == awake {
			return c
		}
	}
	return nil
}

// holdWriter settles a probe TED in a transaction it leaves open and says
// whether its trigger read "busy" (it holds the writers' shared advisory
// lock, sql/migrations/0006_outbox_notify_idle.sql).
func (r *run) holdWriter(ctx context.Context, p *proc) (*probe, bool, error) {
	tx, err := r.mon.Begin(ctx)
	if err != nil {
		return nil, false, fmt.Errorf("begin: %w", err)
	}
	t := transfer.Transfer{ID: uuid.New(), FromAccount: probeAccount, ToAccount: "acct-0000", AmountCents: 1_00}
	res, err := transfer.SettleTx(ctx, tx, t)
	if err != nil {
		_ = tx.Rollback(ctx)
		return nil, false, fmt.Errorf("settle: %w", err)
	}
	var held bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks
		WHERE pid = pg_backend_pid() AND locktype = 'advisory' AND mode = 'ShareLock' AND granted)`).Scan(&held); err != nil {
		_ = tx.Rollback(ctx)
		return nil, false, fmt.Errorf("read locks: %w", err)
	}
	if !held {
		if err := tx.Commit(ctx); err != nil {
			return nil, false, fmt.Errorf("commit: %w", err)
		}
		return nil, false, nil
	}
	var peers []*proc
	for _, q := range r.relays {
		if q != p {
			peers = append(peers, q)
		}
	}
	return &probe{relay: p.name, peers: peers, tx: tx, eventID: res.EventID.String(), opened: time.Now()}, true, nil
}

// commitLater commits the held writer probeCommitAfter from now; done is
// closed when it has.
func (r *run) commitLater(pr *probe) (done chan struct{}) {
	done = make(chan struct{})
	go func() {
		defer close(done)
		time.Sleep(probeCommitAfter)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := pr.tx.Commit(ctx); err != nil {
			pr.err = err
			r.problem("probe: commit of the held writer: %v", err)
			return
		}
		pr.committed = time.Now()
		r.mu.Lock()
		r.probes = append(r.probes, pr)
		r.mu.Unlock()
	}()
	return done
}

// idleFlagValue reads the relays' idle flag: 0 busy, 1 asleep, -1 unknown.
func (r *run) idleFlagValue(ctx context.Context) int {
	ctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	var v int
	if err := r.mon.QueryRow(ctx, "SELECT last_value FROM outbox_relay_idle").Scan(&v); err != nil {
		return -1
	}
	return v
}

// judgeProbes reports each probe: how long its TED took from commit to
// the stream, and whether the other relays slept throughout (otherwise a
// relay that woke rescued the TED and the probe proved nothing). Stranded
// probes are counted by the stranded analysis itself.
func (r *run) judgeProbes(events []eventTiming, windows []window, res *Result) {
	byID := map[string]eventTiming{}
	for _, e := range events {
		byID[e.ID] = e
	}
	r.mu.Lock()
	probes := r.probes
	r.mu.Unlock()
	for _, pr := range probes {
		res.Probes++
		e, ok := byID[pr.eventID]
		slept := pr.ready
		for _, q := range pr.peers {
			if n := wakeChanges(q.logPath, pr.opened, pr.committed.Add(strandedAfter)); n != 0 {
				slept = false
			}
		}
		if slept {
			res.ProbesExact++
		}
		how := "the other relays slept throughout: only the hand-over could wake them"
		if !slept {
			how = "another relay was awake meanwhile (not a test of the hand-over)"
		}
		if !ok {
			r.detail("probe %s: %s stopped with a writer open; event not published; %s", pr.eventID, pr.relay, how)
			continue
		}
		if !calm(windows, e.Commit) {
			how += "; committed near a fault: not judged"
		}
		r.detail("probe %s: %s stopped with a writer open; committed %s, published %s later; %s",
			pr.eventID, pr.relay, stamp(e.Commit), e.delay().Round(time.Millisecond), how)
	}
}

// wakeChanges counts a relay's "wake state" log lines between from and to.
func wakeChanges(logPath string, from, to time.Time) int {
	f, err := os.Open(logPath)
	if err != nil {
		return -1
	}
	defer f.Close()
	n := 0
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for sc.Scan() {
		line := sc.Bytes()
		if !bytes.Contains(line, []byte(`msg="wake state"`)) {
			continue
		}
		ts, _, _ := strings.Cut(strings.TrimPrefix(string(line), "time="), " ")
		at, err := time.Parse(time.RFC3339Nano, ts)
		if err == nil && !at.Before(from) && !at.After(to) {
			n++
		}
	}
	return n
}
