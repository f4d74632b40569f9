// Package redischeck reads, from INFO, the Redis settings exactly-once
// depends on: an evicting maxmemory-policy can drop the consumers' dedupe
// markers (and, for the allkeys policies, the streams themselves) under
// memory pressure, so that a redelivered event takes effect twice; without
// an append-only file a restart loses what the relays marked published.
// INFO is allowed where CONFIG is not (managed Redis services), and on a
// Redis Cluster every node is read: a replica becomes a master on failover.
package redischeck

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/redis/go-redis/v9"
)

// ErrEvicting is wrapped by Refuse's error: a node evicts keys under memory
// pressure.
var ErrEvicting = errors.New("redis evicts keys under memory pressure")

// Node is what one Redis node says of the settings.
type Node struct {
	Addr   string // the node's address, as the client reached it
	Policy string // maxmemory_policy
	AOF    bool   // aof_enabled
}

// Evicting reports whether the node's policy evicts keys.
func (n Node) Evicting() bool { return n.Policy != "" && n.Policy != "noeviction" }

// Inspect reads INFO memory and persistence from rdb's server, or from
// every node of a Redis Cluster. It returns the nodes it could read, and an
// error naming those it could not (or a client it cannot inspect: neither
// *redis.Client nor *redis.ClusterClient); a caller refuses on what it read
// and warns about the rest.
func Inspect(ctx context.Context, rdb any) ([]Node, error) {
	switch c := rdb.(type) {
	case *redis.ClusterClient:
		return inspectCluster(ctx, c)
	case *redis.Client:
		n, err := inspect(ctx, c)
		if err != nil {
			return nil, err
		}
		return []Node{n}, nil
	case interface{ Unwrap() *redis.Client }: // a test's wrapper of a client
		return Inspect(ctx, c.Unwrap())
	}
	return nil, fmt.Errorf("cannot read INFO through a %T", rdb)
}

// inspect reads one node, a section at a time (Redis before 7 takes one).
func inspect(ctx context.Context, c *redis.Client) (Node, error) {
	n := Node{Addr: c.Options().Addr}
	for _, section := range []string{"memory", "persistence"} {
		info, err := c.Info(ctx, section).Result()
		if err != nil {
			return n, fmt.Errorf("INFO %s on %s: %w", section, n.Addr, err)
		}
		for line := range strings.SplitSeq(info, "\n") {
			k, v, ok := strings.Cut(strings.TrimSpace(line), ":")
			switch {
			case !ok:
			case k == "maxmemory_policy":
				n.Policy = v
			case k == "aof_enabled":
				n.AOF = v == "1"
			}
		}
	}
	return n, nil
}

// Refuse returns an error wrapping ErrEvicting, naming the nodes and their
// policies, when any of nodes evicts; override names the setting that
// allows it anyway (a flag, a Config field).
func Refuse(nodes []Node, override string) error {
	var bad []string
	for _, n := range nodes {
		if n.Evicting() {
			bad = append(bad, n.Addr+" "+n.Policy)
		}
	}
	if len(bad) == 0 {
		return nil
	}
	return fmt.Errorf("%w (maxmemory-policy: %s): the dedupe markers, or the streams, can be evicted and "+
		"a redelivered event take effect twice; set maxmemory-policy noeviction (writes then fail loudly "+
		"and are retried), or start with %s if you accept that", ErrEvicting, strings.Join(bad, ", "), override)
}

// NoAOF returns the addresses of the nodes without an append-only file.
func NoAOF(nodes []Node) []string {
	var addrs []string
	for _, n := range nodes {
		if !n.AOF {
			addrs = append(addrs, n.Addr)
		}
	}
	return addrs
}

// inspectCluster reads every node CLUSTER NODES lists, masters and
// replicas alike (CLUSTER SLOTS, and so the client's own view, can leave out
// a replica still syncing), but those the cluster marks failed or without
// an address. It reaches each node with the cluster client's credentials
// and TLS settings.
func inspectCluster(ctx context.Context, c *redis.ClusterClient) ([]Node, error) {
	list, err := c.ClusterNodes(ctx).Result()
	if err != nil {
		return nil, fmt.Errorf("CLUSTER NODES: %w", err)
	}
	o := c.Options()
	var (
		nodes []Node
		errs  []error
	)
	for line := range strings.SplitSeq(strings.TrimSpace(list), "\n") {
		f := strings.Fields(line)
		if len(f) < 3 || strings.Contains(f[2], "fail") || strings.Contains(f[2], "noaddr") || strings.Contains(f[2], "handshake") {
			continue
		}
		addr, _, _ := strings.Cut(f[1], "@") // ip:port@cport[,hostname]
		n := redis.NewClient(&redis.Options{
			Addr: addr, Username: o.Username, Password: o.Password, CredentialsProvider: o.CredentialsProvider,
			TLSConfig: o.TLSConfig, Dialer: o.Dialer, DialTimeout: o.DialTimeout, ReadTimeout: o.ReadTimeout,
			WriteTimeout: o.WriteTimeout, Protocol: o.Protocol, PoolSize: 1, MaxRetries: -1,
		})
		node, err := inspect(ctx, n)
		_ = n.Close()
		if err != nil {
			errs = append(errs, err) // a node announced at an address this client cannot reach (NAT)
			continue
		}
		nodes = append(nodes, node)
	}
	return nodes, errors.Join(errs...)
}
