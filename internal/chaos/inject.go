package chaos

import (
	"context"
	"fmt"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
)

// failpoint restarts a relay or a consumer (SIGTERM, which must exit 0) with
// the fail point armed at a random hit, and waits for it to fire.
func (r *run) failpoint(point string) (detail, note string) {
	group := r.relays
	if strings.HasPrefix(point, "fraud.") {
		group = r.consumers
	}
	p := group[r.rng.IntN(len(group))]
	spec := fmt.Sprintf("%s:%d", point, 1+r.rng.IntN(3))
	detail = p.name + " " + spec
	if _, err := p.arm(spec); err != nil {
		r.problem("arming %s: %v", detail, err)
	}
	// Traffic through the point: a burst every 2 s until it fires, the
	// first once the restarted process has had a second to take its share
	// (the load keeps TEDs for them: load.go, reserve).
	burst := time.NewTicker(2 * time.Second)
	first := time.After(time.Second)
	defer burst.Stop()
	deadline := time.After(30 * time.Second)
	for {
		select {
		case <-p.fired:
			return detail, "fired: the process SIGKILLed itself there"
		case <-first:
			r.requestBurst()
		case <-burst.C:
			r.requestBurst()
		case <-deadline:
			p.kill()
			return detail, "did not fire within 30s (no traffic?); killed instead"
		}
	}
}

// busyError restarts a relay (SIGTERM) with the relay.after-busy error point
// armed at a random hit: one round trip that set the idle flag to "busy"
// fails, as after a terminated backend or a statement timeout. The relay
// stays up; it must not go to sleep believing writers notify it.
func (r *run) busyError() (detail, note string) {
	p := r.relays[r.rng.IntN(len(r.relays))]
	spec := fmt.Sprintf("relay.after-busy:%d", 1+r.rng.IntN(3))
	detail = p.name + " " + spec
	inc := p.incarnationNo()
	if _, err := p.arm(spec); err != nil {
		r.problem("arming %s: %v", detail, err)
	}
	// A relay says "busy" when a second claim in a row finds rows: a burst.
	r.requestBurst()
	nextBurst := time.Now().Add(3 * time.Second)
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if p.incarnationNo() > inc && p.logged("failpoint relay.after-busy") {
			return detail, "fired: a busy round trip failed; the relay stays up"
		}
		if time.Now().After(nextBurst) {
			r.requestBurst()
			nextBurst = time.Now().Add(3 * time.Second)
		}
	}
	return detail, "did not fire within 30s (no traffic?)"
}

// calmPhase injects nothing for a while: the stranded analysis judges the
// events committed then (stranded.go). After a busy error there is always
// one: a relay that went to sleep with writers silent strands the events of
// the next seconds.
func (r *run) calmPhase() {
	d := r.between(4*time.Second, 8*time.Second)
	r.logf("calm for %s", d)
	time.Sleep(d)
}

// rollingDeploy redeploys every relay in turn: each is stopped gracefully
// (SIGTERM, which must exit 0) during a burst followed by a lull, while it
// is draining and writers do not notify, and its successor starts a deploy
// gap later; the next relay goes once it is listening. Meanwhile the other
// relays must get every event within milliseconds: the stopping relay
// hands its wake-ups over on its way out. Where it can, each step is a
// hand-over probe (probe.go): the relay stopped is the one that said
// "busy" while the others sleep, with a writer that saw it busy still
// open; otherwise the relay is stopped towards the end of the burst (in
// the lull no later commit's NOTIFY rescues what it left).
func (r *run) rollingDeploy(ctx context.Context) {
	r.logf("rolling deploy: redeploying %d relays one by one", len(r.relays))
	todo := slices.Clone(r.relays)
	for len(todo) > 0 {
		var (
			p       = todo[0]
			pr      *probe
			started bool
			into    time.Time
		)
		for try := 1; pr == nil && try <= probeBursts; try++ {
			select {
			case <-r.burstStarted: // an earlier burst's
			default:
			}
			r.requestDeployBurst()
			select {
			case <-r.burstStarted:
				started = true
			case <-time.After(5 * time.Second):
				started = false
				r.logf("rolling deploy: no burst started within 5s (the load is over?)")
			}
			into = time.Now().Add(120*time.Millisecond + time.Duration(r.rng.Int64N(int64(140*time.Millisecond))))
			if !started {
				break
			}
			var search bool
			if p, pr, search = r.openProbe(ctx, todo); !search {
				break
			}
		}
		if pr == nil && started {
			// Into the burst (if the probe did not search past that).
			time.Sleep(time.Until(into))
		}
		todo = slices.DeleteFunc(todo, func(q *proc) bool { return q == p })
		inc := p.incarnationNo()
		gap := r.between(1500*time.Millisecond, 3*time.Second)
		var committed chan struct{}
		if pr != nil {
			committed = r.commitLater(pr)
		}
		took, err := p.redeploy(gap)
		if err != nil {
			r.problem("rolling deploy: %v", err)
		}
		how := "during a burst"
		if pr != nil {
			<-committed
			how = "as the lone busy relay, with a writer open that saw it busy"
			if !pr.ready {
				how = "with a writer open that saw it busy (another relay woke meanwhile)"
			}
		}
		for deadline := time.Now().Add(30 * time.Second); ctx.Err() == nil && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			if p.incarnationNo() > inc && p.logged(`msg=listening`) {
				break
			}
		}
		r.mu.Lock()
		r.restarts++
		r.mu.Unlock()
		r.logf("rolling deploy: %s stopped in %s %s, back after a %s gap", p.name, took.Round(time.Millisecond), how, gap)
		if len(todo) > 0 {
			time.Sleep(r.between(500*time.Millisecond, 2*time.Second))
		}
	}
}

// idleFlag describes the relays' idle flag (0006_outbox_notify_idle.sql)
// just before a kill: a relay killed while the flag says "draining" leaves
// writers silent until some relay says it sleeps again.
func (r *run) idleFlag(ctx context.Context) string {
	switch r.idleFlagValue(ctx) {
	case 0:
		return "; idle flag 0 (a relay was draining: writers did not notify)"
	case 1:
		return "; idle flag 1 (writers notified)"
	}
	return "; idle flag unknown"
}

func (r *run) pgTerminate(ctx context.Context) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	var n int
	err := r.mon.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE datname = current_database() AND pid <> pg_backend_pid() AND application_name LIKE 'outbox-%'`).Scan(&n)
	return n, err
}

// redisOOM makes Redis refuse writes for d (maxmemory 1 byte,
// noeviction), then restores maxmemory 0, and checks that the relays backed
// off instead of retrying in a hot loop.
func (r *run) redisOOM(ctx context.Context, d time.Duration, underLoad bool) string {
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	used, err := infoField(cctx, r, "memory", "used_memory")
	cancel()
	if err != nil {
		r.problem("redis INFO memory: %v", err)
		return "skipped"
	}
	statsBefore := r.xaddStats(ctx)
	backoffsBefore := r.countInRelayLogs("redis unavailable; backing off")
	// 1 byte: every write is refused, whatever the memory does meanwhile
	// (half of INFO's used_memory refused no XADD in one run: memory that
	// Redis does not count against maxmemory, or that was freed, is in it).
	limit := "1"
	if err := r.rdb.ConfigSet(ctx, "maxmemory", limit).Err(); err != nil {
		r.problem("CONFIG SET maxmemory %s: %v", limit, err)
	}
	if underLoad {
		r.requestBurst() // TEDs to publish while Redis refuses them
	}
	time.Sleep(d)
	// Retry: the restore must not be lost to a transient error.
	for i := 0; ; i++ {
		err := r.rdb.ConfigSet(ctx, "maxmemory", "0").Err()
		if err == nil {
			break
		}
		if i == 20 {
			r.problem("CONFIG SET maxmemory 0: %v", err)
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	statsAfter := r.xaddStats(ctx)
	backoffs := r.countInRelayLogs("redis unavailable; backing off") - backoffsBefore
	// A relay that backs off exponentially (100ms doubling to 1s, a probe of
	// one row a step) makes at most about two attempts a second; one
	// retrying in a loop makes hundreds. Allow two attempts per second per
	// relay, plus slack for the first steps.
	allowed := int(math.Ceil(2*d.Seconds()))*len(r.relays) + 10
	note := fmt.Sprintf("maxmemory %s (used %d) for %s: relay publish rounds refused %d (allowed %d), XADD calls refused %d, accepted %d",
		limit, used, d, backoffs, allowed, statsAfter.rejected-statsBefore.rejected, statsAfter.calls-statsBefore.calls)
	// Under load, a run whose refusals all refused nothing did not test
	// them (Result.unfired).
	if statsAfter.rejected > statsBefore.rejected {
		note = "fired: " + note
	} else {
		note = "Redis refused no XADD: " + note
	}
	if backoffs > allowed {
		r.problem("redis-oom: relays retried %d times in %s (hot loop?); %s", backoffs, d, note)
	}
	return note
}

type cmdStats struct{ calls, rejected int64 }

// xaddStats reads XADD's calls and rejected_calls from INFO commandstats.
func (r *run) xaddStats(ctx context.Context) cmdStats {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	info, err := r.rdb.Info(ctx, "commandstats").Result()
	if err != nil {
		return cmdStats{}
	}
	var s cmdStats
	for _, line := range strings.Split(info, "\n") {
		rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_xadd:")
		if !ok {
			continue
		}
		for _, kv := range strings.Split(rest, ",") {
			k, v, _ := strings.Cut(kv, "=")
			n, _ := strconv.ParseInt(v, 10, 64)
			switch k {
			case "calls":
				s.calls = n
			case "rejected_calls":
				s.rejected = n
			}
		}
	}
	return s
}

func infoField(ctx context.Context, r *run, section, field string) (int64, error) {
	info, err := r.rdb.Info(ctx, section).Result()
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			return strconv.ParseInt(v, 10, 64)
		}
	}
	return 0, fmt.Errorf("INFO %s has no %s", section, field)
}

func (r *run) countInRelayLogs(s string) int {
	n := 0
	for _, p := range r.relays {
		b, err := os.ReadFile(p.logPath)
		if err == nil {
			n += strings.Count(string(b), s)
		}
	}
	return n
}
