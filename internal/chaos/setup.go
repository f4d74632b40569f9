package chaos

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/tcpproxy"
	"github.com/tedbank/outbox/internal/testenv"
)

func (r *run) setup(ctx context.Context) error {
	if r.cfg.Binary == "" {
		r.cfg.Binary = filepath.Join(r.cfg.Dir, "outbox")
		r.logf("building the outbox binary")
		out, err := exec.CommandContext(ctx, "go", "build", "-tags", "failpoint", "-o", r.cfg.Binary, "github.com/tedbank/outbox/cmd/outbox").CombinedOutput()
		if err != nil {
			return fmt.Errorf("go build: %v\n%s", err, out)
		}
	}
	var err error
	r.pg, err = testenv.LocalPostgres(ctx, testenv.Options{ExtraArgs: postgresArgs})
	if err != nil {
		return err
	}
	if r.cfg.Cluster {
		if r.cluster, err = testenv.LocalRedisCluster(ctx, testenv.Options{ExtraArgs: r.cfg.RedisArgs}); err != nil {
			return err
		}
		r.logf("postgres %s (dir %s), redis cluster %s %v", r.pg.URL, r.pg.Dir(), r.cluster.URL, r.cfg.RedisArgs)
	} else {
		if r.rds, err = testenv.LocalRedis(ctx, testenv.Options{ExtraArgs: r.cfg.RedisArgs}); err != nil {
			return err
		}
		r.logf("postgres %s (dir %s), redis %s %v (dir %s)", r.pg.URL, r.pg.Dir(), r.rds.URL, r.cfg.RedisArgs, r.rds.Dir())
	}
	r.dbURL, _, err = testenv.CreateDatabase(ctx, r.pg.URL, "chaos")
	if err != nil {
		return err
	}
	out, err := exec.CommandContext(ctx, r.cfg.Binary, "migrate", "--database-url", r.dbURL).CombinedOutput()
	if err != nil {
		return fmt.Errorf("outbox migrate: %v\n%s", err, out)
	}

	pgAddr := hostPort(r.pg.URL)
	if r.pgProxy, err = tcpproxy.Start(pgAddr); err != nil {
		return err
	}
	r.relayDB = strings.Replace(r.dbURL, pgAddr, r.pgProxy.Addr(), 1)
	if r.mon, err = monitorPool(ctx, r.dbURL); err != nil {
		return err
	}
	common := []string{"--partitions", strconv.Itoa(r.parts)}
	relayOnly := []string{}
	if r.cfg.Ownership != "" {
		relayOnly = append(relayOnly, "--ownership", r.cfg.Ownership)
	}
	if r.cfg.Cluster {
		// The nodes' own addresses: a cluster client follows the addresses
		// the cluster gives out, so a proxy in front would be bypassed.
		r.proxyRDS = r.cluster.URL
		common = append(common, "--redis-cluster", "--min-replicas", strconv.Itoa(r.cfg.MinReplicas))
		o, err := redis.ParseClusterURL(r.cluster.URL)
		if err != nil {
			return err
		}
		o.ClientName = "chaos-monitor"
		o.DialTimeout, o.ReadTimeout, o.WriteTimeout = time.Second, 2*time.Second, 2*time.Second
		r.rdb = redis.NewClusterClient(o)
	} else {
		rdsAddr := hostPort(r.rds.URL)
		if r.rdsProxy, err = tcpproxy.Start(rdsAddr); err != nil {
			return err
		}
		r.proxyRDS = strings.Replace(r.rds.URL, rdsAddr, r.rdsProxy.Addr(), 1)
		o, err := redis.ParseURL(r.rds.URL)
		if err != nil {
			return err
		}
		o.ClientName = "chaos-monitor"
		o.MaxRetries = 1
		o.DialTimeout, o.ReadTimeout, o.WriteTimeout = time.Second, 2*time.Second, 2*time.Second
		r.rdb = redis.NewClient(o)
	}
	if r.cfg.NATS {
		natsArgs, err := r.setupNATS(ctx)
		if err != nil {
			return err
		}
		common = append(common, natsArgs...)
	}
	r.relayArgs, r.fraudArgs = slices.Concat(relayArgs, common, relayOnly), slices.Concat(fraudArgs, common)

	for _, name := range []string{"r1", "r2"} {
		args := append([]string{"relay", "--name", name, "--database-url", r.relayDB, "--redis-url", r.proxyRDS}, r.relayArgs...)
		r.relays = append(r.relays, newProc(name, r.cfg.Binary, filepath.Join(r.cfg.Dir, name+".log"), r.logf, args...))
	}
	for _, name := range []string{"c1", "c2"} {
		args := append([]string{"fraud", "--consumer", name, "--redis-url", r.proxyRDS}, r.fraudArgs...)
		r.consumers = append(r.consumers, newProc(name, r.cfg.Binary, filepath.Join(r.cfg.Dir, name+".log"), r.logf, args...))
	}
	ledgerURL, _, err := testenv.CreateDatabase(ctx, r.pg.URL, "ledger")
	if err != nil {
		return err
	}
	if err := r.setupLedger(ctx, ledgerURL); err != nil {
		return err
	}
	for _, name := range []string{"l1", "l2"} {
		args := slices.Concat([]string{"ledger", "--consumer", name, "--redis-url", r.proxyRDS, "--ledger-database-url", ledgerURL},
			ledgerArgs, withoutFlag(common, "--min-replicas")) // its effects are in PostgreSQL, not Redis
		r.ledgers = append(r.ledgers, newProc(name, r.cfg.Binary, filepath.Join(r.cfg.Dir, name+".log"), r.logf, args...))
	}
	r.procs = slices.Concat(r.relays, r.consumers, r.ledgers)
	for _, p := range r.procs {
		go p.supervise()
	}
	// Let every process come up before the load starts.
	deadline := time.Now().Add(30 * time.Second)
	for _, p := range r.procs {
		for !p.ready() {
			if time.Now().After(deadline) {
				return fmt.Errorf("%s did not start; see %s", p.name, p.logPath)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return nil
}

// teardown stops whatever is still running and keeps the servers' logs.
func (r *run) teardown() {
	if r.ledgerDB != nil {
		defer r.ledgerDB.Close()
	}
	for _, p := range r.procs {
		p.mu.Lock()
		p.stopping = true
		if p.aliveLocked() {
			_ = killGroup(p.cmd.Process.Pid)
		}
		p.mu.Unlock()
		<-p.loopDone
	}
	if r.mon != nil {
		r.mon.Close()
	}
	if r.rdb != nil {
		_ = r.rdb.Close()
	}
	if r.nc != nil {
		r.nc.Close()
	}
	for _, px := range []*tcpproxy.Proxy{r.pgProxy, r.rdsProxy, r.natsProxy} {
		if px != nil {
			_ = px.Close()
		}
	}
	servers := map[string]*testenv.Server{"postgres.log": r.pg, "redis.log": r.rds, "nats.log": r.nats}
	if r.cluster != nil {
		for i, n := range r.cluster.Nodes {
			servers[fmt.Sprintf("redis-node-%d.log", i)] = n
		}
	}
	for name, s := range servers {
		if s == nil {
			continue
		}
		if b, err := os.ReadFile(s.LogPath()); err == nil {
			_ = os.WriteFile(filepath.Join(r.cfg.Dir, name), b, 0o644)
		}
		_ = s.Close()
	}
}

// stopAll sends SIGTERM to every process and requires each to exit 0 within
// termGrace.
func (r *run) stopAll() {
	var wg sync.WaitGroup
	for _, p := range r.procs {
		wg.Go(func() {
			took, err := p.terminate(true)
			p.release() // a held process (redis-loss) is not started again: it is stopping
			if err != nil {
				r.problem("SIGTERM: %v", err)
				return
			}
			r.logf("%s exited 0 %s after SIGTERM", p.name, took.Round(time.Millisecond))
		})
	}
	wg.Wait()
	for _, p := range r.procs {
		<-p.loopDone
		exits, problems, n := p.report()
		var parts []string
		for k, v := range exits {
			parts = append(parts, fmt.Sprintf("%s:%d", k, v))
		}
		sort.Strings(parts)
		r.detail("%s: %d incarnations, exits %s", p.name, n, strings.Join(parts, ","))
		for _, pr := range problems {
			r.problem("%s", pr)
		}
	}
}

// LogTails returns the last lines of every log in dir, for a failed run.
func LogTails(dir string, lines int) string {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, e := range entries {
		if e.IsDir() || !strings.HasSuffix(e.Name(), ".log") {
			continue
		}
		data, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			continue
		}
		all := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
		fmt.Fprintf(&b, "----- %s (last %d of %d lines) -----\n", e.Name(), min(lines, len(all)), len(all))
		b.WriteString(strings.Join(all[max(0, len(all)-lines):], "\n"))
		b.WriteString("\n")
	}
	return b.String()
}

// withoutFlag returns args without the flag name and its value.
func withoutFlag(args []string, name string) []string {
	var out []string
	for i := 0; i < len(args); i++ {
		if args[i] == name {
			i++
			continue
		}
		out = append(out, args[i])
	}
	return out
}
