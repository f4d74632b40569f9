package consumer

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// The Redis path, by hand: a handler whose state lives in Redis applies
// each message's effect with a Lua script that, atomically (a script runs
// whole or not at all, and must do every check before its first write),
// does what follows. NewRedisEffect writes that script around the Lua of
// one message's effect, so that none of it can be left out; CheckScript
// checks a script written by hand for it. In detail:
//
//  1. refuses with an error starting "FENCED" when the batch has a Fence
//     and the partition's lease (Batch.Keys.Lease(Batch.Group)) holds
//     another value: the consumer lost the partition;
//  2. returns "duplicate" when the event's marker key exists;
//  3. writes the effect and sets the marker, with a TTL that outlives every
//     redelivery (Config.CheckDedupeWindow).
//
// Its keys go under Batch.Keys.Prefix, so that on a Redis Cluster they
// share the partition stream's hash slot. RunScripts runs calls in one
// round trip; package fraud is such a handler (it sends a batch's first
// call of up to 100 events alone, and its other calls in one pipeline once
// the first replied).
//
// A pipeline (or one call applying several messages) cannot stop between
// its effects, so a script error that struck one message and not a later
// one of the same key would let the later one take effect first (see
// Handler; the consumer logs it). A script that can fail for one message
// only (a key of the wrong type, a check of its own) gates the batch itself,
// as anti-fraud's effect.lua does: a failing message records its key in a
// hash named for the batch, and the key's later messages in the batch find
// it there and refuse. What a handler finds wrong before the pipeline, it
// holds with an Order.

// ScriptCall is one script call: the effect of one message, or of several
// (anti-fraud's effect.lua applies up to 100 per call, its reply an array
// with one element per message, which the handler reads).
type ScriptCall struct {
	Script *redis.Script // nil: no call (the message had nothing to apply)
	Keys   []string
	Args   []any
}

// Replicas asks RunScripts to wait (Redis WAIT, on the connection that
// wrote the effects) until Min replicas have them, Timeout at most; effects
// they do not confirm are reported as failed, so their messages stay
// pending and are applied again (the markers make that harmless where an
// effect survived). Min 0 does not wait.
type Replicas struct {
	Min     int
	Timeout time.Duration
}

// RunScripts runs calls, the effects of b's messages, in one pipeline
// (loading a script first if Redis does not have it), followed, with
// replicas.Min, by a WAIT. It returns each call's reply, or its error: an
// error starting "FENCED" wraps ErrFenced.
func RunScripts(ctx context.Context, rdb redis.Cmdable, b Batch, calls []ScriptCall, replicas Replicas) ([]*redis.Cmd, []error) {
	replies := make([]*redis.Cmd, len(calls))
	errs := make([]error, len(calls))
	failAll := func(err error) ([]*redis.Cmd, []error) {
		for i := range errs {
			errs[i] = err
		}
		return replies, errs
	}
	node, err := pipelinerFor(ctx, rdb, b, replicas)
	if err != nil {
		return failAll(err)
	}
	var wait *redis.Cmd
	run := func() error {
		_, err := node.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, call := range calls {
				if call.Script != nil {
					replies[i] = call.Script.EvalSha(ctx, p, call.Keys, call.Args...)
				}
			}
			if replicas.Min > 0 {
				// On the connection that wrote the effects.
				wait = p.Do(ctx, "wait", replicas.Min, replicas.Timeout.Milliseconds())
			}
			return nil
		})
		return err
	}
	if err := run(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
		// First use, or Redis restarted: load the scripts and run again.
		// Calls that did run were applied and now find their markers.
		loaded := map[*redis.Script]bool{}
		for _, call := range calls {
			if call.Script == nil || loaded[call.Script] {
				continue
			}
			if lerr := call.Script.Load(ctx, rdb).Err(); lerr != nil {
				return failAll(fmt.Errorf("load script: %w", lerr))
			}
			loaded[call.Script] = true
		}
		_ = run() // each call's error is in its reply
	}
	unconfirmed := unconfirmed(wait, replicas)
	moved := false
	for i, reply := range replies {
		if reply == nil {
			continue
		}
		switch err := reply.Err(); {
		case err != nil && redis.HasErrorPrefix(err, "FENCED"):
			errs[i] = fmt.Errorf("%w: %w", ErrFenced, err)
		case err != nil:
			errs[i] = err
			moved = moved || movedSlot(err)
		default:
			errs[i] = unconfirmed
		}
	}
	if cc, ok := rdb.(*redis.ClusterClient); ok && moved {
		cc.ReloadState(ctx) // the slot moved under the master's own connection
	}
	return replies, errs
}

// unconfirmed says why the replicas did not confirm the effects, if they
// did not.
func unconfirmed(wait *redis.Cmd, replicas Replicas) error {
	if wait == nil {
		return nil
	}
	if n, err := wait.Int64(); err != nil {
		return fmt.Errorf("wait for %d replicas: %w", replicas.Min, err)
	} else if n < int64(replicas.Min) {
		return fmt.Errorf("effects confirmed by %d of %d replicas within %s", n, replicas.Min, replicas.Timeout)
	}
	return nil
}

// pipeliner is what RunScripts needs to apply a batch of effects.
type pipeliner interface {
	Pipelined(ctx context.Context, fn func(redis.Pipeliner) error) ([]redis.Cmder, error)
}

// pipelinerFor returns where b's effects are pipelined: the client, or, on a
// Redis Cluster with replicas to wait for, a connection to the master
// serving b's slot, so that the WAIT after the effects runs on the
// connection that wrote them (on a cluster client it would go to any node).
func pipelinerFor(ctx context.Context, rdb redis.Cmdable, b Batch, replicas Replicas) (pipeliner, error) {
	cc, ok := rdb.(*redis.ClusterClient)
	if !ok || replicas.Min == 0 {
		return rdb, nil
	}
	node, err := cc.MasterForKey(ctx, b.Stream)
	if err != nil {
		return nil, fmt.Errorf("find the master of partition %d: %w", b.Partition, err)
	}
	return node, nil
}

// movedSlot: a Redis Cluster redirection (MOVED, ASK) reached the consumer
// on a connection to one master.
func movedSlot(err error) bool {
	_, moved := redis.IsMovedError(err)
	_, ask := redis.IsAskError(err)
	return moved || ask
}
