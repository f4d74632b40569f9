package chaos

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/tcpproxy"
)

// planned is a fault to inject: its kind and, for some kinds, which variant
// (a fail point, a blackhole target, a PostgreSQL stop mode).
type planned struct{ kind, variant string }

var (
	blackholeTargets = []string{"pg", "redis", "pg+redis"}
	pgStopModes      = []string{"fast", "immediate", "kill"}
	masterKillModes  = []string{"plain", "lagging"}
	// weights of the random faults after the mandatory ones.
	weights = map[string]int{
		KillRelay: 3, KillConsumer: 3, Failpoint: 3, PGTerminate: 2, RedisClientKill: 2,
		Blackhole: 1, PGRestart: 1, RedisKill: 1, RedisOOM: 1, BusyError: 2,
		RollingDeploy: 1, MasterKill: 2, MasterStop: 1, Reshard: 1, ConsumerJoin: 1, ConsumerLeave: 1,
		NATSKill: 2, NATSRestart: 1, Stall: 2, PGFlap: 1, BigPayloads: 1, LongTx: 1, RedisLoss: 1,
	}
	// stallTargets: a stall stops one relay or one anti-fraud consumer.
	stallTargets         = []string{"relay", "fraud"}
	natsBlackholeTargets = []string{"pg", "nats", "redis"}
)

// killOne: a kill of one relay, or of one anti-fraud consumer, that leaves
// the others of its group running (the failover measured in failover.go).
const killOne = "one"

// mandatory is the faults every run injects: two busy errors and two
// rolling deploys first (they only matter while events flow), then each fail
// point, then every other kind and variant in a random order. On a cluster,
// the cluster's own faults, then the fail points, then the rest.
func (r *run) mandatory() []planned {
	var fps, rest []planned
	for _, fp := range Failpoints {
		fps = append(fps, planned{Failpoint, fp})
	}
	rest = []planned{
		{KillRelay, ""}, {KillConsumer, ""}, {PGTerminate, ""}, {RedisClientKill, ""},
		{Blackhole, "pg"}, {Blackhole, "redis"}, {RedisKill, ""}, {RedisOOM, ""}, {PGFlap, ""},
	}
	// On a cluster its own faults come first, while the load runs.
	var first []planned
	if r.cfg.Cluster {
		first = []planned{
			{MasterKill, "plain"}, {MasterKill, "lagging"}, {MasterStop, ""}, {Reshard, ""},
			{ConsumerJoin, ""}, {ConsumerLeave, ""},
		}
		if !r.cfg.Short {
			first = append(first, planned{MasterKill, "lagging"}, planned{Reshard, ""}, planned{ConsumerJoin, ""})
		}
		// The measured failovers too: the load ends before the traffic
		// faults come on a cluster.
		first = append(first, planned{KillRelay, killOne}, planned{KillConsumer, killOne},
			planned{Stall, "relay"}, planned{Stall, "fraud"}, planned{BigPayloads, ""}, planned{LongTx, ""})
		r.rng.Shuffle(len(first), func(i, j int) { first[i], first[j] = first[j], first[i] })
		rest = []planned{{KillRelay, ""}, {KillConsumer, ""}, {PGTerminate, ""}, {Blackhole, "pg"}, {PGFlap, ""}}
	}
	if r.cfg.NATS {
		// The broker's own faults first, while the load runs; Redis's only
		// where the consumers' effects are (the relays never touch it).
		first = []planned{{NATSKill, ""}, {Blackhole, "nats"}, {NATSRestart, ""}}
		if !r.cfg.Short {
			first = append(first, planned{NATSKill, ""}, planned{Blackhole, "nats"})
		}
		r.rng.Shuffle(len(first), func(i, j int) { first[i], first[j] = first[j], first[i] })
		rest = []planned{
			{KillRelay, ""}, {KillConsumer, ""}, {PGTerminate, ""}, {RedisClientKill, ""}, {Blackhole, "pg"}, {RedisKill, ""},
			{PGFlap, ""},
		}
		if !r.cfg.Short {
			rest = append(rest, planned{Blackhole, "redis"})
		}
	}
	if r.cfg.Short {
		rest = append(rest, planned{PGRestart, pgStopModes[r.rng.IntN(len(pgStopModes))]})
	} else {
		if !r.cfg.Cluster && !r.cfg.NATS { // the cluster's nodes have no proxy
			rest = append(rest, planned{Blackhole, "pg+redis"})
		}
		for _, m := range pgStopModes {
			rest = append(rest, planned{PGRestart, m})
		}
	}
	r.rng.Shuffle(len(fps), func(i, j int) { fps[i], fps[j] = fps[j], fps[i] })
	r.rng.Shuffle(len(rest), func(i, j int) { rest[i], rest[j] = rest[j], rest[i] })
	// The busy errors and the deploys need events flowing: first, then the
	// fail points (which need some traffic too).
	// So do the measured failovers (failover.go): one relay and one
	// anti-fraud consumer killed while the others run.
	// So do the stalls: a stopped relay or consumer holds work only while
	// events flow.
	// So do the faults of the data: big payloads beside TEDs, a backlog
	// under a held horizon, a Redis that loses what was just published.
	traffic := []planned{{BusyError, ""}, {RollingDeploy, ""}, {BusyError, ""}, {RollingDeploy, ""},
		{KillRelay, killOne}, {KillConsumer, killOne}, {Stall, "relay"}, {Stall, "fraud"},
		{BigPayloads, ""}, {LongTx, ""}, {RedisLoss, ""}}
	if r.cfg.NATS { // the busy error is Redis's, which the relays do not use
		traffic = []planned{{RollingDeploy, ""}, {RollingDeploy, ""}, {KillRelay, killOne}, {KillConsumer, killOne},
			{Stall, "relay"}, {Stall, "fraud"}, {BigPayloads, ""}, {LongTx, ""}}
	}
	r.rng.Shuffle(len(traffic), func(i, j int) { traffic[i], traffic[j] = traffic[j], traffic[i] })
	switch {
	case r.cfg.Cluster:
		// The fail points right after the cluster's faults, while the
		// load still runs (on a single Redis the load outlasts them all).
		traffic = slices.DeleteFunc(traffic, func(f planned) bool {
			return f.variant == killOne || f.kind == Stall || f.kind == BigPayloads || f.kind == LongTx || f.kind == RedisLoss
		})
		return slices.Concat(first, fps, traffic, rest)
	case r.cfg.NATS:
		return slices.Concat(first, traffic, fps, rest)
	}
	return slices.Concat(traffic, fps, rest)
}

// random picks a weighted random fault of the run's mode.
func (r *run) random() planned {
	kinds := append(slices.Clone(Result{Cluster: r.cfg.Cluster, NATS: r.cfg.NATS}.kinds()), RollingDeploy)
	total := 0
	for _, k := range kinds {
		total += weights[k]
	}
	n := r.rng.IntN(total)
	kind := kinds[0]
	for _, k := range kinds {
		if n < weights[k] {
			kind = k
			break
		}
		n -= weights[k]
	}
	switch kind {
	case Failpoint:
		return planned{kind, Failpoints[r.rng.IntN(len(Failpoints))]}
	case Blackhole:
		switch {
		case r.cfg.Cluster:
			return planned{kind, "pg"} // the cluster's nodes have no proxy
		case r.cfg.NATS:
			return planned{kind, natsBlackholeTargets[r.rng.IntN(len(natsBlackholeTargets))]}
		}
		return planned{kind, blackholeTargets[r.rng.IntN(len(blackholeTargets))]}
	case MasterKill:
		return planned{kind, masterKillModes[r.rng.IntN(len(masterKillModes))]}
	case PGRestart:
		return planned{kind, pgStopModes[r.rng.IntN(len(pgStopModes))]}
	case Stall:
		return planned{kind, stallTargets[r.rng.IntN(len(stallTargets))]}
	}
	return planned{kind: kind}
}

// between returns a random duration in [lo, hi].
func (r *run) between(lo, hi time.Duration) time.Duration {
	if r.cfg.Short || hi <= lo {
		return lo
	}
	return (lo + time.Duration(r.rng.Int64N(int64(hi-lo)))).Round(100 * time.Millisecond)
}

func (r *run) settled() bool {
	select {
	case <-r.settleDone:
		return true
	default:
		return false
	}
}

// injectFaults injects the mandatory faults, then random ones until the load
// is settled, one at a time: each fault, then the wait for the pipeline to
// recover, then a random pause.
func (r *run) injectFaults(ctx context.Context) {
	plan := r.mandatory()
	r.mustFireLeft.Store(int32(len(slices.DeleteFunc(slices.Clone(plan), func(f planned) bool {
		return !slices.Contains(mustFire, f.kind)
	}))))
	defer r.mustFireLeft.Store(0)
	for i := 0; ctx.Err() == nil; i++ {
		var f planned
		if i < len(plan) {
			f = plan[i]
		} else {
			if r.settled() {
				return
			}
			f = r.random()
		}
		pause := 300*time.Millisecond + time.Duration(r.rng.Int64N(int64(1700*time.Millisecond)))
		if r.cfg.Short {
			pause = 300*time.Millisecond + time.Duration(r.rng.Int64N(int64(700*time.Millisecond)))
		}
		time.Sleep(pause)
		if f.kind == RollingDeploy {
			r.rollingDeploy(ctx)
			r.calmPhase()
			continue
		}
		rec := r.inject(ctx, f)
		if i < len(plan) && slices.Contains(mustFire, f.kind) {
			r.mustFireLeft.Add(-1)
		}
		rec.Recovery = r.waitRecovery(ctx, rec)
		r.mu.Lock()
		r.faults = append(r.faults, rec)
		r.mu.Unlock()
		rs := "never"
		if rec.Recovery >= 0 {
			rs = rec.Recovery.Round(10 * time.Millisecond).String()
		}
		load := "load running"
		if !rec.UnderLoad {
			load = "after the load"
		}
		r.logf("fault #%d %s %s (%s): %s; recovered in %s", len(r.faults), rec.Kind, rec.Detail, load, rec.Note, rs)
		if rec.Recovery < 0 {
			// The pipeline is stuck (events lost?): more faults would only
			// wait for it again. Go on to the checks, which say what is wrong.
			r.stuck = true
			r.logf("the pipeline did not recover: no more faults")
			return
		}
		if f.kind == BusyError || r.rng.IntN(2) == 0 {
			r.calmPhase()
		}
	}
}

func (r *run) inject(ctx context.Context, f planned) FaultRecord {
	rec := FaultRecord{Kind: f.kind, Detail: f.variant, Start: time.Now(), UnderLoad: !r.settled()}
	r.logf("injecting %s %s", f.kind, f.variant)
	switch f.kind {
	case KillRelay, KillConsumer:
		group := r.relays
		rec.Group = "relay"
		if f.kind == KillConsumer {
			// Anti-fraud's consumers, or the ledger's (the inbox path).
			group, rec.Group = r.consumers, "fraud"
			if f.variant != killOne && r.rng.IntN(3) == 0 {
				group, rec.Group = r.ledgers, "ledger"
			}
		}
		targets := []*proc{group[r.rng.IntN(len(group))]}
		if f.variant != killOne && r.rng.IntN(4) == 0 {
			targets = group
		}
		rec.Survivors = len(group) - len(targets)
		flag := ""
		if f.kind == KillRelay {
			flag = r.idleFlag(ctx)
		}
		var names []string
		for _, p := range targets {
			p.kill()
			names = append(names, p.name)
		}
		rec.Detail = strings.Join(names, "+")
		rec.Note = "SIGKILL" + flag
	case Failpoint:
		rec.Detail, rec.Note = r.failpoint(f.variant)
	case BusyError:
		rec.Detail, rec.Note = r.busyError()
	case Stall:
		group := r.relays
		if f.variant == "fraud" {
			group = r.consumers
		}
		p := group[r.rng.IntN(len(group))]
		d := r.between(3*time.Second, 6*time.Second)
		rec.Group, rec.Survivors = f.variant, len(group)-1
		rec.Detail = p.name
		if p.stop() {
			time.Sleep(d)
			p.cont()
			rec.Note = fmt.Sprintf("SIGSTOP for %s, its connections open, then SIGCONT", d)
		} else {
			rec.Note = "not running: nothing to stop"
		}
	case BigPayloads:
		rec.Note = r.bigPayloads(ctx)
	case LongTx:
		rec.Note = r.longTransaction(ctx, r.between(3*time.Second, 6*time.Second))
	case RedisLoss:
		note, err := r.redisLoss(ctx, r.between(2*time.Second, 4*time.Second))
		if err != nil {
			r.problem("redis-loss: %v", err)
			note = "failed: " + err.Error()
		}
		rec.Note = note
	case PGFlap:
		total := 0
		for i := range 4 {
			if i > 0 {
				time.Sleep(time.Second)
			}
			n, err := r.pgTerminate(ctx)
			if err != nil {
				r.problem("pg-flap: %v", err)
				break
			}
			total += n
		}
		rec.Note = fmt.Sprintf("pg_terminate_backend on the outbox sessions 4 times, 1 s apart: %d sessions", total)
	case PGTerminate:
		n, err := r.pgTerminate(ctx)
		rec.Note = fmt.Sprintf("pg_terminate_backend on %d outbox sessions", n)
		if err != nil {
			rec.Note = "pg_terminate_backend failed: " + err.Error()
		}
	case RedisClientKill:
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		n, err := r.rdb.Do(cctx, "CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes").Int()
		cancel()
		rec.Note = fmt.Sprintf("CLIENT KILL TYPE normal SKIPME yes: %d clients", n)
		if err != nil {
			rec.Note = "CLIENT KILL failed: " + err.Error()
		}
	case Blackhole:
		d := r.between(4*time.Second, 8*time.Second)
		var proxies []*tcpproxy.Proxy
		if strings.Contains(f.variant, "pg") {
			proxies = append(proxies, r.pgProxy)
		}
		if strings.Contains(f.variant, "redis") && r.rdsProxy != nil {
			proxies = append(proxies, r.rdsProxy)
		}
		if strings.Contains(f.variant, "nats") && r.natsProxy != nil {
			proxies = append(proxies, r.natsProxy)
		}
		// Every connection, old or opened meanwhile, goes silent (bytes
		// swallowed, nothing closed) for d. Afterwards new connections flow;
		// the silent ones stay silent until their client gives up on them.
		end := time.Now().Add(d)
		for time.Now().Before(end) {
			for _, px := range proxies {
				px.Freeze()
			}
			time.Sleep(50 * time.Millisecond)
		}
		rec.Note = fmt.Sprintf("connections through the proxy frozen (half-open) for %s", d)
	case PGRestart:
		d := r.between(3*time.Second, 6*time.Second)
		var err error
		switch f.variant {
		case "fast":
			err = r.pg.Stop()
		case "immediate":
			err = r.pg.StopWith(syscall.SIGQUIT)
		default:
			err = r.pg.Kill()
		}
		if err != nil {
			r.problem("stop postgres (%s): %v", f.variant, err)
		}
		time.Sleep(d)
		if err := r.pg.Start(ctx); err != nil {
			r.problem("restart postgres: %v", err)
		}
		rec.Note = fmt.Sprintf("postgres %s stop, down %s", f.variant, d)
	case RedisKill:
		d := r.between(time.Second, 3*time.Second)
		if err := r.rds.Kill(); err != nil {
			r.problem("kill redis: %v", err)
		}
		time.Sleep(d)
		if err := r.rds.Start(ctx); err != nil {
			r.problem("restart redis: %v", err)
		}
		rec.Note = fmt.Sprintf("redis-server SIGKILLed, down %s", d)
	case RedisOOM:
		rec.Note = r.redisOOM(ctx, r.between(4*time.Second, 8*time.Second), rec.UnderLoad)
	case MasterKill:
		rec.Detail, rec.Note = r.masterKill(ctx, f.variant)
	case MasterStop:
		rec.Detail, rec.Note = r.masterStop(ctx)
	case Reshard:
		rec.Detail, rec.Note = r.reshard(ctx)
	case ConsumerJoin:
		rec.Detail, rec.Note = r.consumerJoin(ctx)
	case ConsumerLeave:
		rec.Detail, rec.Note = r.consumerLeave()
	case NATSKill:
		rec.Note = r.natsDown(ctx, true, r.between(time.Second, 3*time.Second))
	case NATSRestart:
		rec.Note = r.natsDown(ctx, false, r.between(time.Second, 3*time.Second))
	}
	rec.End = time.Now()
	return rec
}

// waitRecovery measures the recovery time of a fault: from the end of the
// fault until every TED committed by then has a verdict — the backlog the
// fault left has drained end to end, through relay and anti-fraud. It
// returns -1 if that takes longer than two minutes.
func (r *run) waitRecovery(ctx context.Context, rec FaultRecord) time.Duration {
	const limit = 2 * time.Minute
	deadline := rec.End.Add(limit)
	var unjudged, senders []string
	for {
		ids, from, err := r.unjudged(ctx)
		if err == nil {
			unjudged, senders = ids, from
			break
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			r.problem("after %s %s: cannot read the backlog: %v", rec.Kind, rec.Detail, err)
			return -1
		}
		time.Sleep(100 * time.Millisecond)
	}
	for len(unjudged) > 0 {
		if time.Now().After(deadline) || ctx.Err() != nil {
			r.problem("after %s %s: %d TEDs committed before the fault ended still have no verdict after %s",
				rec.Kind, rec.Detail, len(unjudged), limit)
			return -1
		}
		time.Sleep(50 * time.Millisecond)
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		vals, err := fraud.ReadVerdictsOf(cctx, r.rdb, r.fraudKeys(), unjudged, senders)
		cancel()
		if err != nil {
			continue
		}
		var left, leftFrom []string
		for i, v := range vals {
			if v == "" {
				left, leftFrom = append(left, unjudged[i]), append(leftFrom, senders[i])
			}
		}
		unjudged, senders = left, leftFrom
	}
	return time.Since(rec.End)
}

// unjudged returns the ids of the committed transfers without a verdict,
// and their senders.
func (r *run) unjudged(ctx context.Context) (ids, senders []string, err error) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	rows, err := r.mon.Query(ctx, "SELECT id::text, from_account FROM transfers")
	if err != nil {
		return nil, nil, err
	}
	defer rows.Close()
	var all, from []string
	for rows.Next() {
		var id, sender string
		if err := rows.Scan(&id, &sender); err != nil {
			return nil, nil, err
		}
		all, from = append(all, id), append(from, sender)
	}
	if err := rows.Err(); err != nil {
		return nil, nil, err
	}
	verdicts, err := fraud.ReadVerdictsOf(ctx, r.rdb, r.fraudKeys(), all, from)
	if err != nil {
		return nil, nil, err
	}
	for i, id := range all {
		if verdicts[i] == "" {
			ids, senders = append(ids, id), append(senders, from[i])
		}
	}
	return ids, senders, nil
}
