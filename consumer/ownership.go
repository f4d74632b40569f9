package consumer

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/partition"
)

// Partition ownership: the consumers of a group divide the stream's
// partitions among themselves, and only a partition's owner applies its
// events, one at a time in stream order, so that one sender's TEDs are judged
// in the order they were settled, however many consumers run.
//
// Each consumer says it is alive in the group's members set (members.lua)
// and wants the partitions p with p mod M = i, i being its place among the M
// live members sorted by name. It holds each one with a lease
// (Keys.Lease, lease.lua) that it renews every PartitionLease/4, and gives
// back the ones it no longer wants (a member joined) after their worker has
// stopped. A consumer that dies keeps its leases until they expire: its
// partitions move within PartitionLease.
//
// The lease value is the fencing token: the effect script applies an event
// only while the partition's lease still holds the value its consumer took,
// so a consumer that stalled past its lease, or lost it to a rebalance, can
// never apply an effect next to the new owner.

var (
	//go:embed lease.lua
	leaseSrc string
	//go:embed members.lua
	membersSrc string

	leaseScript   = redis.NewScript(leaseSrc)
	membersScript = redis.NewScript(membersSrc)
	// releaseScript deletes a lease only if it still holds the value given.
	releaseScript = redis.NewScript(`if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0`)
)

// coordination is what the consumers of a group share besides the messages,
// in Redis whatever the source: their membership and presence
// (presence.go), the partition leases that fence the effects (below), the
// consumers' names (name.go), and the partitions' dead letters and stats
// (Keys). A Consumer applies its partitions; its coordination says which.
type coordination struct {
	rdb   redis.Cmdable
	cfg   Config
	keys  Keys   // the group's keys as a whole (names, members)
	parts []part // the stream's partitions, with their keys
	log   *slog.Logger
	// token identifies this process in its leases; leaseRenewed is when
	// it last renewed its name's.
	token        string
	leaseRenewed time.Time
}

// part is one partition of the consumed stream.
type part struct {
	n      int    // its number
	stream string // its stream
	keys   Keys   // the keys of its consumer state (one hash slot with the stream)
}

// parts lists the partitions of cfg's stream.
func parts(cfg Config) []part {
	keys := Keys{Prefix: cfg.KeyPrefix, Partitions: cfg.Partitions}.Each()
	ps := make([]part, len(keys))
	for p := range ps {
		ps[p] = part{n: p, stream: partition.Stream(cfg.Stream, p, cfg.Partitions), keys: keys[p]}
	}
	return ps
}

// holder is how this process appears in its leases: its name and its
// token, which tells it apart from an earlier process of the same name.
func (g *coordination) holder() string { return g.cfg.Consumer + "|" + g.token }

// worker is a partition this consumer owns, and the goroutine applying it.
type worker struct {
	fence  string // the lease value it holds
	cancel context.CancelFunc
	done   chan struct{}
}

// own runs the ownership loop until ctx is cancelled, then stops every
// worker, gives their leases back and leaves the members. It returns
// errNameTaken, having stopped its workers, when another process took this
// consumer's name (renewName).
func (c *Consumer) own(ctx context.Context) error {
	// The presence connection says this consumer lives: it closes last,
	// once the workers have finished their batches and given their
	// partitions back (defers run in reverse), so that the others do not
	// take a stopping consumer for dead.
	pres := &presence{g: c.group, absent: map[string]time.Time{}}
	defer pres.close()
	workers := map[int]*worker{}
	stop := func(p int, release bool) {
		w := workers[p]
		w.cancel()
		<-w.done
		delete(workers, p)
		if release {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
			defer cancel()
			if err := c.group.release(rctx, c.parts[p], w.fence); err != nil {
				c.log.Warn("giving a partition back failed; it moves when its lease expires",
					slog.Int("partition", p), slog.Any("error", err))
			}
		}
	}
	// The heartbeat runs until the workers have finished their batches
	// (a consumer stopping is not a stalled one: the others must not take
	// its partitions from under a batch), and stops before the membership
	// is left, so that it does not write the membership back. Its context
	// is not ctx's: a shutdown cancels ctx first.
	hctx, stopHeartbeat := context.WithCancel(context.WithoutCancel(ctx))
	var heartbeat sync.WaitGroup
	heartbeat.Go(func() { c.group.heartbeat(hctx) })
	nameTaken := false
	defer func() {
		for p := range workers {
			stop(p, true)
		}
		stopHeartbeat()
		heartbeat.Wait()
		if nameTaken {
			return // the membership under this name is the other process's now
		}
		// Leave the group now rather than when the membership runs out (a
		// partition lease): the others take the partitions given back at
		// their next tick.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		defer cancel()
		if err := c.group.leave(rctx); err != nil {
			c.log.Warn("leaving the group's members failed; the others rebalance when the membership runs out", slog.Any("error", err))
		}
	}()

	// A full pass (name, membership, leases) every renewEvery, and at once
	// when the members changed; in between, every presenceEvery, the
	// membership's heartbeat and a look for dead members (presence.go).
	renewEvery := min(c.cfg.PartitionLease/4, c.group.nameLeaseTTL()/3)
	fast := time.NewTicker(min(presenceEvery, renewEvery))
	defer fast.Stop()
	var want []int
	var lastMembers []string
	for {
		if err := pres.open(ctx); err != nil && ctx.Err() == nil {
			c.log.Debug("opening the presence connection failed; retrying", slog.Any("error", err))
		}
		if err := c.group.renewName(ctx); err != nil {
			c.log.Error("another process runs under this consumer name, started while this one was away; "+
				"standing down for good (give each consumer its own --consumer)",
				slog.String("key", c.keys.Consumer(c.cfg.Group, c.cfg.Consumer)))
			nameTaken = true
			return err
		}
		if members, _, err := c.group.members(ctx); err != nil {
			if ctx.Err() == nil {
				c.log.Warn("reading the group's members failed", slog.Any("error", err))
			}
		} else {
			want, lastMembers = c.assigned(members), members
		}
		// The partitions handed over: every worker told to stop first, then
		// the wanted partitions taken, then the handed-over ones given back
		// once their workers have stopped. A worker blocked reading new
		// entries stops when its read's slice ends (streams.go, readSlice):
		// the partitions freed meanwhile by others need not wait for that.
		var leaving []int
		for p, w := range workers {
			if !slices.Contains(want, p) {
				c.log.Info("partition handed over (rebalance)", slog.Int("partition", p))
				w.cancel()
				leaving = append(leaving, p)
			}
		}
		for _, p := range want {
			fence, err := c.group.lease(ctx, c.parts[p])
			w := workers[p]
			switch {
			case err != nil:
				// Redis trouble: the worker, if any, finds out by itself;
				// a lease that runs out fences its effects.
				if ctx.Err() == nil {
					c.log.Warn("renewing a partition lease failed", slog.Int("partition", p), slog.Any("error", err))
				}
			case fence == "" && w != nil:
				c.log.Error("partition lease lost (this consumer stalled past it?); stopping the partition",
					slog.Int("partition", p))
				stop(p, false)
			case fence != "" && w != nil && w.fence != fence:
				// Expired and taken again by this process: a new epoch.
				stop(p, false)
				fallthrough
			case fence != "" && workers[p] == nil:
				wctx, cancel := context.WithCancel(ctx)
				w := &worker{fence: fence, cancel: cancel, done: make(chan struct{})}
				workers[p] = w
				c.log.Info("partition taken", slog.Int("partition", p), slog.String("lease", fence))
				go func() {
					defer close(w.done)
					c.work(wctx, c.parts[p], fence)
				}()
			}
		}
		for _, p := range leaving {
			stop(p, true)
		}
		for next := time.Now().Add(renewEvery); time.Now().Before(next); {
			select {
			case <-ctx.Done():
				return nil
			case <-fast.C:
			}
			// Reopened within a tick if Redis dropped it (or the members
			// key moved to another node), so that the others do not take
			// this consumer for dead.
			_ = pres.open(ctx)
			members, scores, err := c.group.members(ctx)
			if err != nil {
				break // the full pass logs it
			}
			if pres.look(ctx, members, scores) || !slices.Equal(members, lastMembers) {
				break
			}
			// A partition this consumer wants but does not hold yet (its
			// previous owner is handing it over) is tried again at once
			// too, not at the next renewal.
			if len(workers) < len(want) {
				break
			}
		}
	}
}

// members says this consumer is alive and returns the group's live members,
// sorted, and each one's membership score (when its membership ends: it
// moves forward at every heartbeat of a live member).
func (g *coordination) members(ctx context.Context) ([]string, map[string]string, error) {
	ttl := g.cfg.PartitionLease.Milliseconds()
	flat, err := membersScript.Run(ctx, g.rdb, []string{g.keys.Members(g.cfg.Group)}, g.cfg.Consumer, ttl).StringSlice()
	if err != nil {
		return nil, nil, err
	}
	names := make([]string, 0, len(flat)/2)
	scores := make(map[string]string, len(flat)/2)
	for i := 0; i+1 < len(flat); i += 2 {
		names = append(names, flat[i])
		scores[flat[i]] = flat[i+1]
	}
	return names, scores, nil
}

// assigned returns the partitions this consumer should own among members.
func (c *Consumer) assigned(members []string) []int {
	i := slices.Index(members, c.cfg.Consumer)
	if i < 0 {
		return nil
	}
	var ps []int
	for p := i; p < len(c.parts); p += len(members) {
		ps = append(ps, p)
	}
	return ps
}

// lease takes or renews pt's lease and returns its value, or "" when
// another consumer holds it.
func (g *coordination) lease(ctx context.Context, pt part) (string, error) {
	v, err := leaseScript.Run(ctx, g.rdb, []string{pt.keys.Lease(g.cfg.Group), pt.keys.LeaseEpoch(g.cfg.Group)},
		g.holder(), g.cfg.PartitionLease.Milliseconds()).Text()
	if err == redis.Nil {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("partition %d lease: %w", pt.n, err)
	}
	return v, nil
}

// holds reports why pt's lease does not hold fence (an error wrapping
// ErrFenced: a newer owner took the partition), or nil.
func (g *coordination) holds(ctx context.Context, pt part, fence string) error {
	v, err := g.rdb.Get(ctx, pt.keys.Lease(g.cfg.Group)).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("check the partition lease before opening the partition: %w", err)
	}
	if v != fence {
		return fmt.Errorf("%w: partition %d's lease holds %q, not %q", ErrFenced, pt.n, v, fence)
	}
	return nil
}

// release gives pt's lease back if it still holds fence.
func (g *coordination) release(ctx context.Context, pt part, fence string) error {
	return releaseScript.Run(ctx, g.rdb, []string{pt.keys.Lease(g.cfg.Group)}, fence).Err()
}

// deadLetter adds fields (a message's, and dlq_* fields that say why) to
// pt's dead-letter stream and counts it in pt's stats, in one transaction.
// (A message of Redis Streams is moved with its XACK instead: streams.go.)
func (g *coordination) deadLetter(ctx context.Context, pt part, fields []any) error {
	_, err := g.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		p.XAdd(ctx, &redis.XAddArgs{Stream: pt.keys.DeadLetters(), Values: fields})
		p.HIncrBy(ctx, pt.keys.Stats(), "dead_lettered", 1)
		return nil
	})
	return err
}

// leave ends this consumer's membership of the group.
func (g *coordination) leave(ctx context.Context) error {
	return g.rdb.ZRem(ctx, g.keys.Members(g.cfg.Group), g.cfg.Consumer).Err()
}

// heartbeat renews this consumer's membership every presenceEvery, on its
// own goroutine: the others take a member whose membership stops moving for
// stallAfter for a stalled process (presence.go), so it must not wait for
// the full pass, which can take longer (a worker finishing its batch before
// it hands a partition over). Its errors are the full pass's to report.
func (g *coordination) heartbeat(ctx context.Context) {
	t := time.NewTicker(presenceEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		_, _, _ = g.members(ctx)
	}
}
