package testenv

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// Cluster is a Redis Cluster of local redis-server processes: 3 masters and
// 3 replicas on loopback ports, as production runs it.
type Cluster struct {
	// URL is go-redis's cluster URL form (redis.ParseClusterURL): the first
	// node in the URL, the others as addr= parameters.
	URL string
	// Nodes are the six servers, in the order given to
	// redis-cli --cluster create (the first three start as masters).
	Nodes []*Server
}

// Close stops every node and removes their files.
func (c *Cluster) Close() error {
	if c == nil {
		return nil
	}
	var errs []error
	for _, n := range c.Nodes {
		errs = append(errs, n.Close())
	}
	return errors.Join(errs...)
}

// Client returns a cluster client for c (the caller closes it).
func (c *Cluster) Client() (*redis.ClusterClient, error) {
	o, err := redis.ParseClusterURL(c.URL)
	if err != nil {
		return nil, err
	}
	return redis.NewClusterClient(o), nil
}

// clusterNodeTimeout is the nodes' cluster-node-timeout: how long a master
// may be unreachable before its replica is promoted.
const clusterNodeTimeout = 2 * time.Second

// LocalRedisCluster starts six redis-server processes with cluster-enabled
// yes (each with its own temporary directory and free port, as LocalRedis),
// joins them with redis-cli --cluster create --cluster-replicas 1, and waits
// until every node reports cluster_state:ok with all 16384 slots assigned
// and three replicas attached. opt.ExtraArgs go to every node. The caller
// must Close it.
func LocalRedisCluster(ctx context.Context, opt Options) (_ *Cluster, err error) {
	cli, err := findBinary("redis-cli", "/usr/bin", "/usr/local/bin")
	if err != nil {
		return nil, err
	}
	c := &Cluster{}
	defer func() {
		if err != nil {
			_ = c.Close()
		}
	}()
	nodeOpt := opt
	nodeOpt.ExtraArgs = append([]string{
		"--cluster-enabled", "yes",
		"--cluster-config-file", "nodes.conf",
		"--cluster-node-timeout", fmt.Sprint(clusterNodeTimeout.Milliseconds()),
	}, opt.ExtraArgs...)
	var addrs []string
	for range 6 {
		n, err := LocalRedis(ctx, nodeOpt)
		if err != nil {
			return nil, fmt.Errorf("cluster node: %w", err)
		}
		c.Nodes = append(c.Nodes, n)
		addrs = append(addrs, strings.TrimSuffix(strings.TrimPrefix(n.URL, "redis://"), "/0"))
	}
	args := append([]string{"--cluster", "create"}, addrs...)
	args = append(args, "--cluster-replicas", "1", "--cluster-yes")
	opt.Logf("testenv: creating the Redis Cluster", "nodes", strings.Join(addrs, " "))
	cctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	if out, err := exec.CommandContext(cctx, cli, args...).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("redis-cli --cluster create: %w\n%s", err, out)
	}
	c.URL = "redis://" + addrs[0] + "?addr=" + strings.Join(addrs[1:], "&addr=")
	if err := c.WaitHealthy(ctx); err != nil {
		return nil, err
	}
	opt.Logf("testenv: Redis Cluster ready", "url", c.URL)
	return c, nil
}

// WaitHealthy waits until every node says the cluster is ok, with all slots
// assigned, and three of them are replicas synced with their masters (after
// a failover, the old master back as the new one's replica).
func (c *Cluster) WaitHealthy(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, readyTimeout)
	defer cancel()
	var last error
	for {
		last = c.healthy(ctx)
		if last == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("redis cluster not healthy within %s: %w", readyTimeout, last)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (c *Cluster) healthy(ctx context.Context) error {
	replicas := 0
	for _, n := range c.Nodes {
		o, err := redis.ParseURL(n.URL)
		if err != nil {
			return err
		}
		rdb := redis.NewClient(o)
		info, err := rdb.ClusterInfo(ctx).Result()
		role, rerr := rdb.Do(ctx, "ROLE").Slice()
		_ = rdb.Close()
		if err != nil {
			return err
		}
		if rerr != nil {
			return rerr
		}
		if !strings.Contains(info, "cluster_state:ok") || !strings.Contains(info, "cluster_slots_ok:16384") {
			return fmt.Errorf("node %s: %s", n.URL, strings.Join(strings.Fields(info)[:3], " "))
		}
		if len(role) > 0 && role[0] == "slave" {
			// ROLE of a replica: slave, master ip, master port, link state,
			// offset. Ready once the link is connected (synced).
			if len(role) < 4 || role[3] != "connected" {
				return fmt.Errorf("replica %s: link %v", n.URL, role[3:])
			}
			replicas++
		}
	}
	if replicas != 3 {
		return fmt.Errorf("%d replicas attached, want 3", replicas)
	}
	return nil
}
