package chaos

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/testenv"
)

// The faults of a Redis Cluster run. Each ends with the cluster healthy
// again (every slot served, three replicas attached), so the next fault
// starts from a whole cluster.

// lagPause is how long a master-kill's "lagging" variant cuts the
// replication link before killing the master: the writes of that time reach
// the master only, as when replication falls behind. Below the node timeout,
// so the replica is still a candidate for promotion.
const lagPause = 1500 * time.Millisecond

// clusterNode is one node as CLUSTER NODES describes it.
type clusterNode struct {
	id, addr string
	master   bool
	of       string // a replica's master id
	slots    int
	srv      *testenv.Server
}

// clusterNodes reads the cluster's view of its nodes from a live node and
// matches each to its server.
func (r *run) clusterNodes(ctx context.Context) ([]clusterNode, error) {
	var last error
	for _, srv := range r.cluster.Nodes {
		if !srv.Running() {
			continue
		}
		o, err := redis.ParseURL(srv.URL)
		if err != nil {
			return nil, err
		}
		o.DialTimeout, o.ReadTimeout = time.Second, 2*time.Second
		c := redis.NewClient(o)
		text, err := c.ClusterNodes(ctx).Result()
		_ = c.Close()
		if err != nil {
			last = err
			continue
		}
		var nodes []clusterNode
		for _, line := range strings.Split(strings.TrimSpace(text), "\n") {
			f := strings.Fields(line)
			if len(f) < 8 {
				continue
			}
			n := clusterNode{id: f[0], addr: strings.Split(f[1], "@")[0], master: strings.Contains(f[2], "master"), of: f[3]}
			if strings.Contains(f[2], "fail") {
				continue
			}
			for _, rg := range f[8:] {
				if strings.HasPrefix(rg, "[") {
					continue // a slot being migrated
				}
				lo, hi, ok := strings.Cut(rg, "-")
				a, _ := strconv.Atoi(lo)
				b := a
				if ok {
					b, _ = strconv.Atoi(hi)
				}
				n.slots += b - a + 1
			}
			for _, s := range r.cluster.Nodes {
				if strings.Contains(s.URL, "//"+n.addr+"/") || strings.HasSuffix(s.URL, "//"+n.addr) {
					n.srv = s
				}
			}
			nodes = append(nodes, n)
		}
		return nodes, nil
	}
	return nil, fmt.Errorf("no node answered CLUSTER NODES: %v", last)
}

// pickMaster picks a random master that serves slots, and its replica.
func (r *run) pickMaster(ctx context.Context) (master, replica clusterNode, err error) {
	nodes, err := r.clusterNodes(ctx)
	if err != nil {
		return master, replica, err
	}
	var masters []clusterNode
	for _, n := range nodes {
		if n.master && n.slots > 0 && n.srv != nil {
			masters = append(masters, n)
		}
	}
	if len(masters) == 0 {
		return master, replica, fmt.Errorf("no master with slots among %d nodes", len(nodes))
	}
	master = masters[r.rng.IntN(len(masters))]
	for _, n := range nodes {
		if !n.master && n.of == master.id && n.srv != nil {
			return master, n, nil
		}
	}
	return master, replica, fmt.Errorf("master %s has no replica", master.addr)
}

// waitMaster waits until node says it is a master (promoted).
func waitMaster(ctx context.Context, node *testenv.Server, limit time.Duration) (time.Duration, error) {
	o, err := redis.ParseURL(node.URL)
	if err != nil {
		return 0, err
	}
	o.DialTimeout, o.ReadTimeout = time.Second, time.Second
	c := redis.NewClient(o)
	defer c.Close()
	start := time.Now()
	for time.Since(start) < limit {
		if role, err := c.Do(ctx, "ROLE").Slice(); err == nil && len(role) > 0 && role[0] == "master" {
			return time.Since(start), nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return time.Since(start), fmt.Errorf("%s not promoted within %s", node.URL, limit)
}

// healthyAgain waits for the whole cluster, and reports a problem if it
// does not come back.
func (r *run) healthyAgain(ctx context.Context, after string) {
	if err := r.cluster.WaitHealthy(ctx); err != nil {
		r.problem("cluster not healthy after %s: %v", after, err)
	}
}

// masterKill SIGKILLs a master; its replica is promoted after the node
// timeout; the old master is started again and rejoins as the new
// master's replica. "lagging" first cuts the replication link for
// lagPause: the replica is paused (SIGSTOP, so it cannot reconnect) and the
// master drops its connection (CLIENT KILL TYPE replica; a paused replica
// alone would still receive everything from its socket buffer when it
// resumes), so that the writes of that time reach only the master. With
// --min-replicas 0 the relay marks them published and they are lost with
// the master; with 1 its WAIT finds no replica and it publishes them again.
func (r *run) masterKill(ctx context.Context, variant string) (detail, note string) {
	m, rep, err := r.pickMaster(ctx)
	if err != nil {
		r.problem("master-kill: %v", err)
		return "", err.Error()
	}
	if variant == "lagging" {
		_ = syscall.Kill(rep.srv.Pid(), syscall.SIGSTOP)
		if err := cutReplicas(ctx, m.srv); err != nil {
			r.problem("master-kill: cut the replication link: %v", err)
		}
		time.Sleep(lagPause)
	}
	if err := m.srv.Kill(); err != nil {
		r.problem("kill master %s: %v", m.addr, err)
	}
	if variant == "lagging" {
		_ = syscall.Kill(rep.srv.Pid(), syscall.SIGCONT)
	}
	took, err := waitMaster(ctx, rep.srv, 30*time.Second)
	if err != nil {
		r.problem("master-kill: %v", err)
	}
	time.Sleep(r.between(time.Second, 3*time.Second))
	if err := m.srv.Start(ctx); err != nil {
		r.problem("restart the killed master %s: %v", m.addr, err)
	}
	r.healthyAgain(ctx, "master-kill")
	lag := ""
	if variant == "lagging" {
		lag = fmt.Sprintf(" after %s without its replica", lagPause)
	}
	return variant, fmt.Sprintf("master %s (%d slots) SIGKILLed%s; replica %s promoted %s later; the old master rejoined as its replica",
		m.addr, m.slots, lag, rep.addr, took.Round(10*time.Millisecond))
}

// cutReplicas closes a master's connections to its replicas.
func cutReplicas(ctx context.Context, master *testenv.Server) error {
	o, err := redis.ParseURL(master.URL)
	if err != nil {
		return err
	}
	o.DialTimeout, o.ReadTimeout = time.Second, 2*time.Second
	c := redis.NewClient(o)
	defer c.Close()
	return c.Do(ctx, "CLIENT", "KILL", "TYPE", "replica").Err()
}

// masterStop stops a master (SIGSTOP) for longer than the node timeout: its
// replica is promoted; the old master, resumed, finds itself demoted and
// becomes the new master's replica (whatever it accepted from its socket
// buffers when it resumed is discarded by the resync).
func (r *run) masterStop(ctx context.Context) (detail, note string) {
	m, rep, err := r.pickMaster(ctx)
	if err != nil {
		r.problem("master-stop: %v", err)
		return "", err.Error()
	}
	d := 2*time.Second + r.between(2*time.Second, 4*time.Second) // node timeout + margin
	_ = syscall.Kill(m.srv.Pid(), syscall.SIGSTOP)
	took, err := waitMaster(ctx, rep.srv, 30*time.Second)
	if err != nil {
		r.problem("master-stop: %v", err)
	}
	if rest := d - took; rest > 0 {
		time.Sleep(rest)
	}
	_ = syscall.Kill(m.srv.Pid(), syscall.SIGCONT)
	r.healthyAgain(ctx, "master-stop")
	return "", fmt.Sprintf("master %s stopped (SIGSTOP) for %s; replica %s promoted after %s", m.addr, max(d, took).Round(100*time.Millisecond), rep.addr, took.Round(10*time.Millisecond))
}

// reshard moves slots between two masters with redis-cli --cluster
// reshard while the load runs: keys move with MIGRATE, clients meet ASK and
// MOVED redirections.
func (r *run) reshard(ctx context.Context) (detail, note string) {
	nodes, err := r.clusterNodes(ctx)
	if err != nil {
		r.problem("reshard: %v", err)
		return "", err.Error()
	}
	var masters []clusterNode
	for _, n := range nodes {
		if n.master && n.slots > 0 {
			masters = append(masters, n)
		}
	}
	if len(masters) < 2 {
		r.problem("reshard: %d masters with slots", len(masters))
		return "", "not enough masters"
	}
	i := r.rng.IntN(len(masters))
	j := (i + 1 + r.rng.IntN(len(masters)-1)) % len(masters)
	from, to := masters[i], masters[j]
	n := min(from.slots-1, 500+r.rng.IntN(1500))
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		r.problem("reshard: %v", err)
		return "", err.Error()
	}
	cctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	start := time.Now()
	out, err := exec.CommandContext(cctx, cli, "--cluster", "reshard", from.addr, "--cluster-from", from.id, "--cluster-to", to.id,
		"--cluster-slots", strconv.Itoa(n), "--cluster-yes").CombinedOutput()
	if err != nil {
		r.problem("redis-cli --cluster reshard: %v\n%s", err, tail(string(out), 10))
	}
	r.healthyAgain(ctx, "reshard")
	return fmt.Sprintf("%d slots", n), fmt.Sprintf("%d slots moved from %s to %s in %s", n, from.addr, to.addr, time.Since(start).Round(100*time.Millisecond))
}

// consumerJoin starts one more anti-fraud consumer of the group: the
// partitions rebalance to it; after a while it leaves (SIGTERM, which must
// exit 0) and they rebalance back.
func (r *run) consumerJoin(ctx context.Context) (detail, note string) {
	r.joined++
	name := fmt.Sprintf("c%d", 2+r.joined)
	args := append([]string{"fraud", "--consumer", name, "--redis-url", r.proxyRDS}, r.fraudArgs...)
	p := newProc(name, r.cfg.Binary, filepath.Join(r.cfg.Dir, name+".log"), r.logf, args...)
	r.procs = append(r.procs, p)
	go p.supervise()
	for deadline := time.Now().Add(20 * time.Second); !p.ready() && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
	}
	stay := r.between(5*time.Second, 10*time.Second)
	time.Sleep(stay)
	took, err := p.terminate(true)
	if err != nil {
		r.problem("consumer-join: %v", err)
	}
	return name, fmt.Sprintf("%s joined the group for %s, then left (SIGTERM, exited in %s)", name, stay, took.Round(time.Millisecond))
}

// consumerLeave stops a consumer gracefully (it hands its partitions over)
// and starts it again a few seconds later (they come back to it).
func (r *run) consumerLeave() (detail, note string) {
	p := r.consumers[r.rng.IntN(len(r.consumers))]
	gap := r.between(3*time.Second, 8*time.Second)
	took, err := p.redeploy(gap)
	if err != nil {
		r.problem("consumer-leave: %v", err)
	}
	return p.name, fmt.Sprintf("%s left the group (SIGTERM, exited in %s) and rejoined %s later", p.name, took.Round(time.Millisecond), gap)
}

// tail returns the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
