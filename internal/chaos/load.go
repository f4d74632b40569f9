package chaos

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/queries"
)

// settleLoop runs `outbox settle` directly against PostgreSQL until the
// database holds cfg.N transfers. A settle process that fails (PostgreSQL
// stopped, its sessions terminated) exits non-zero; then the transfers that
// did commit are counted in the database, not in settle's summary (a commit
// whose acknowledgement was lost counts too), and settle is started again for
// the remainder.
//
// The load comes in phases (nextPhase): steady stretches at cfg.Rate, bursts
// that keep the relays draining (they tell writers to stop notifying, and
// must tell them to notify again before they sleep), and lulls in which the
// relays sleep and each next commit must wake one.
func (r *run) settleLoop(ctx context.Context) {
	defer close(r.settleDone)
	logPath := filepath.Join(r.cfg.Dir, "settle.log")
	for ctx.Err() == nil {
		committed, err := r.committed(ctx)
		if err != nil {
			time.Sleep(250 * time.Millisecond)
			continue
		}
		remaining := r.cfg.N - committed
		if remaining <= 0 {
			if remaining < 0 {
				r.problem("%d transfers committed, more than the %d settled", committed, r.cfg.N)
			}
			r.logf("load done: %d transfers committed by %d settle runs (%d bursts, %d lulls)", committed, r.settleRuns, r.bursts, r.lulls)
			return
		}
		ph, ok := r.reserve(r.nextPhase(), remaining, int(r.mustFireLeft.Load()))
		if !ok {
			time.Sleep(100 * time.Millisecond)
			continue
		}
		if ph.lull > 0 {
			r.lulls++
			time.Sleep(ph.lull)
			continue
		}
		count := min(ph.count, remaining)
		r.settleRuns++
		log, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			r.problem("settle log: %v", err)
			return
		}
		runCtx, cut := context.WithCancel(ctx)
		if ph.burst {
			r.bursts++
			if ph.lullAfter > 0 { // a deploy's: it may cut the burst short
				r.mu.Lock()
				r.burstCut, r.burstEnded = cut, make(chan struct{})
				r.mu.Unlock()
			}
			select {
			case r.burstStarted <- struct{}{}:
			default:
			}
		}
		fmt.Fprintf(log, "=== chaos: settle run #%d for %d TEDs at %g/s (%d committed) at %s\n", r.settleRuns, count, ph.rate, committed, stamp(time.Now()))
		cmd := exec.CommandContext(runCtx, r.cfg.Binary, "settle", "--database-url", r.dbURL,
			"--count", strconv.Itoa(count), "--rate", strconv.FormatFloat(ph.rate, 'f', -1, 64),
			"--concurrency", strconv.Itoa(r.cfg.Concurrency), "--json",
			// A fifth of the TEDs as a plain SQL writer writes them (no
			// partition_key, no writer lock: migration 0015 keys and orders
			// them), among the others of the same senders.
			"--plain-sql", "0.2")
		cmd.Env = cleanEnv()
		cmd.Stdout, cmd.Stderr = log, log
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
		err = cmd.Run()
		wasCut := runCtx.Err() != nil && ctx.Err() == nil
		cut()
		r.mu.Lock()
		if r.burstEnded != nil {
			close(r.burstEnded)
			r.burstCut, r.burstEnded = nil, nil
		}
		r.mu.Unlock()
		if wasCut {
			err = nil // the suite ended the burst (cutBurst); what committed is counted
			fmt.Fprintf(log, "=== chaos: settle run #%d cut short by the suite\n", r.settleRuns)
		}
		fmt.Fprintf(log, "=== chaos: settle run #%d ended: %v\n", r.settleRuns, err)
		_ = log.Close()
		if ph.lullAfter > 0 {
			r.lulls++
			time.Sleep(ph.lullAfter)
		}
		if err != nil {
			r.logf("settle run #%d failed (%v); counting what committed and settling the rest", r.settleRuns, err)
			time.Sleep(500 * time.Millisecond)
		}
	}
}

// phase is one stretch of load: count TEDs at rate, or a lull.
type phase struct {
	count int
	rate  float64
	burst bool
	lull  time.Duration
	// lullAfter: no load for this long after the phase (a deploy's burst:
	// rows committed just before a relay stopped must not be rescued by the
	// next commit's NOTIFY).
	lullAfter time.Duration
	// requested: a fault asked for this burst (requestBurst,
	// requestDeployBurst); it may take the TEDs held for such faults.
	requested bool
}

// Load phases: a steady stretch lasts steadyFor at cfg.Rate; a burst is
// burstCount TEDs at burstFactor times that rate (at least burstMinRate).
const (
	steadyFor    = 3 * time.Second
	burstCount   = 60
	burstFactor  = 10
	burstMinRate = 300
	// deployBurstCount: a deploy's burst is longer (a hand-over probe waits
	// in it for one relay to be the lone busy one, then cuts it). Not
	// faster: at a thousand TEDs a second both relays drain side by side.
	deployBurstCount = 150
	// deployLull follows a deploy's burst: long enough that a probe's
	// writer commits in it and has a second with no other commit
	// (probe.go).
	deployLull = 3 * time.Second
)

// nextPhase picks the next phase: a burst when a fault asked for one
// (requestBurst), otherwise steady 60%, burst 25%, lull 15% of the time.
func (r *run) nextPhase() phase {
	burst := phase{count: burstCount, rate: max(burstFactor*r.cfg.Rate, burstMinRate), burst: true}
	select {
	case <-r.deployBurst:
		burst.count, burst.lullAfter, burst.requested = deployBurstCount, deployLull, true
		return burst
	case <-r.burstNow:
		burst.requested = true
		return burst
	default:
	}
	switch n := r.loadRng.IntN(100); {
	case n < 60:
		return phase{count: max(1, int(r.cfg.Rate*steadyFor.Seconds())), rate: r.cfg.Rate}
	case n < 85:
		return burst
	default:
		return phase{lull: time.Second + time.Duration(r.loadRng.Int64N(int64(time.Second)))}
	}
}

// reserve keeps the load's last TEDs for the faults that test something only
// when traffic makes them fire (mustFire: left of them not injected yet),
// which come after the faults that need the load running: a run whose
// other faults took longer than the load once armed its fail points with
// nothing left to settle. Below 2 × hold TEDs left (hold: a burst's worth
// for each such fault), the load trickles at a quarter of its rate, and a
// burst a fault asks for (requestBurst) is a third of a burst, so that each
// fault has three; below hold, it settles only the bursts faults ask for
// (those, and a deploy's), and reports false meanwhile. ph is the phase
// nextPhase chose.
func (r *run) reserve(ph phase, remaining, left int) (phase, bool) {
	hold := burstCount * left
	switch {
	case left == 0 || remaining > 2*hold:
		return ph, true
	case ph.requested:
		if ph.lullAfter == 0 { // not a deploy's
			ph.count = min(ph.count, burstCount/3)
		}
		return ph, true
	case remaining > hold:
		return phase{count: min(remaining-hold, 5), rate: max(r.cfg.Rate/4, 1)}, true
	}
	return phase{}, false
}

// cutBurst ends a deploy's burst now: its settle process is killed, and
// cutBurst returns once it has exited (no more commits of that burst). A
// TED in flight commits or not; the next settle run counts what did.
func (r *run) cutBurst() {
	r.mu.Lock()
	cut, ended := r.burstCut, r.burstEnded
	r.mu.Unlock()
	if cut == nil {
		return
	}
	cut()
	select {
	case <-ended:
	case <-time.After(5 * time.Second):
		r.problem("the deploy burst's settle run did not exit 5s after it was cut")
	}
}

// maxPhaseCount is the most TEDs one settle run settles.
func (r *run) maxPhaseCount() int {
	return max(deployBurstCount, int(r.cfg.Rate*steadyFor.Seconds()))
}

// requestDeployBurst makes the next load phase a burst followed by a lull.
func (r *run) requestDeployBurst() {
	select {
	case r.deployBurst <- struct{}{}:
	default:
	}
}

// requestBurst makes the next load phase a burst.
func (r *run) requestBurst() {
	select {
	case r.burstNow <- struct{}{}:
	default:
	}
}

// committed counts the transfers in the database.
func (r *run) committed(ctx context.Context) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	var n int
	err := r.mon.QueryRow(ctx, "SELECT count(*) FROM transfers").Scan(&n)
	return n, err
}

// backlog is the number of TEDs committed in PostgreSQL that anti-fraud has
// not judged yet: transfers minus effects applied.
func (r *run) backlog(ctx context.Context) (int, error) {
	committed, err := r.committed(ctx)
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	verdicts, err := r.verdictCount(ctx)
	if err != nil {
		return 0, err
	}
	return committed - verdicts, nil
}

// outboxCounts returns the outbox rows by status.
func (r *run) outboxCounts(ctx context.Context) (pending, publishing, published, dead int, err error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	var oldest float64
	var retrying int
	q := queries.Status("")
	err = r.mon.QueryRow(ctx, q.SQL, q.Args...).Scan(&pending, &publishing, &published, &dead, &oldest, &retrying)
	return
}

// progress logs the state of the pipeline every few seconds.
func (r *run) progress(ctx context.Context) {
	t := time.NewTicker(5 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		committed, err1 := r.committed(ctx)
		backlog, err2 := r.backlog(ctx)
		pending, publishing, published, dead, err3 := r.outboxCounts(ctx)
		if err1 != nil || err2 != nil || err3 != nil {
			r.logf("progress: unavailable (%v %v %v)", err1, err2, err3)
			continue
		}
		r.logf("progress: committed %d, unjudged %d, outbox pending %d publishing %d published %d dead %d",
			committed, backlog, pending, publishing, published, dead)
	}
}

// monitorPool is the suite's own connection to the database, direct (not
// through the proxy) and named so that the pg-terminate fault spares it.
func monitorPool(ctx context.Context, dbURL string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = "chaos-monitor"
	cfg.ConnConfig.ConnectTimeout = time.Second
	cfg.MaxConns = 4
	return pgxpool.NewWithConfig(ctx, cfg)
}

func hostPort(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		return ""
	}
	return u.Host
}

func killGroup(pid int) error { return syscall.Kill(-pid, syscall.SIGKILL) }

// verdictCount is how many effects anti-fraud applied (its stats counter;
// verify checks it against the verdicts themselves).
func (r *run) verdictCount(ctx context.Context) (int, error) {
	total := 0
	for _, k := range r.fraudKeys().Each() {
		n, err := r.rdb.HGet(ctx, k.Stats(), "verdicts").Int()
		if err != nil && !errors.Is(err, redis.Nil) {
			return 0, err
		}
		total += n
	}
	return total, nil
}
