package consumer

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"
)

// CheckScript checks an effect script of one's own, written for RunScripts,
// for what the Redis path needs of it, on rdb under keys (a scratch prefix
// of the caller's, empty): in a batch whose Fence the partition's lease
// does not hold, it fails with an error starting "FENCED" and writes
// nothing; applied, it replies something other than Duplicate; applied
// again, it replies Duplicate and writes nothing. call returns the script
// call of the batch's one message m. CheckScript returns what is missing
// (errors.Join of each), or nil. A RedisEffect's script passes it by
// construction; run it in a test of a script written by hand.
func CheckScript(ctx context.Context, rdb redis.Cmdable, keys Keys, m Message, call func(b Batch) ScriptCall) error {
	const group = "check"
	lease := keys.Lease(group)
	if err := rdb.Set(ctx, lease, "2|check|"+uuid.NewString(), 0).Err(); err != nil {
		return fmt.Errorf("check script: set the lease: %w", err)
	}
	owner, err := rdb.Get(ctx, lease).Result()
	if err != nil {
		return fmt.Errorf("check script: %w", err)
	}
	batch := func(fence string) Batch {
		return Batch{Stream: keys.Prefix + "check-stream", Keys: keys, Fence: fence, Group: group, Messages: []Message{m}}
	}
	run := func(b Batch) (string, error) {
		replies, errs := RunScripts(ctx, rdb, b, []ScriptCall{call(b)}, Replicas{})
		if errs[0] != nil {
			return "", errs[0]
		}
		if replies[0] == nil {
			return "", errors.New("no script call")
		}
		out, _ := replies[0].Text()
		return out, nil
	}
	var missing []error
	before, err := snapshot(ctx, rdb, keys.Prefix)
	if err != nil {
		return err
	}
	switch out, err := run(batch("1|stale|" + uuid.NewString())); {
	case err == nil:
		missing = append(missing, fmt.Errorf("fence: a batch whose fence the partition's lease does not hold replied %q, want an error starting FENCED", out))
	case !errors.Is(err, ErrFenced):
		missing = append(missing, fmt.Errorf("fence: a batch whose fence the partition's lease does not hold failed with %v, want an error starting FENCED", err))
	}
	if after, err := snapshot(ctx, rdb, keys.Prefix); err != nil {
		return err
	} else if changed := diff(before, after); len(changed) > 0 {
		missing = append(missing, fmt.Errorf("fence: a fenced batch wrote %v: every check must come before the first write", changed))
	}
	out, err := run(batch(owner))
	switch {
	case err != nil:
		return errors.Join(append(missing, fmt.Errorf("apply: the message failed: %w", err))...)
	case out == Duplicate:
		missing = append(missing, fmt.Errorf("once: the message's first application replied %q", out))
	}
	applied, err := snapshot(ctx, rdb, keys.Prefix)
	if err != nil {
		return err
	}
	if out, err := run(batch(owner)); err != nil || out != Duplicate {
		missing = append(missing, fmt.Errorf("once: the message applied again replied %q (%v), want %q", out, err, Duplicate))
	}
	if again, err := snapshot(ctx, rdb, keys.Prefix); err != nil {
		return err
	} else if changed := diff(applied, again); len(changed) > 0 {
		missing = append(missing, fmt.Errorf("once: the message applied again wrote %v", changed))
	}
	return errors.Join(missing...)
}

// snapshot returns the serialized value of every key under prefix.
func snapshot(ctx context.Context, rdb redis.Cmdable, prefix string) (map[string]string, error) {
	vals := map[string]string{}
	iter := rdb.Scan(ctx, 0, prefix+"*", 1000).Iterator()
	for iter.Next(ctx) {
		v, err := rdb.Dump(ctx, iter.Val()).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			return nil, fmt.Errorf("check script: dump %s: %w", iter.Val(), err)
		}
		vals[iter.Val()] = v
	}
	if err := iter.Err(); err != nil {
		return nil, fmt.Errorf("check script: scan %s*: %w", prefix, err)
	}
	return vals, nil
}

// diff returns the keys whose values differ between a and b, sorted.
func diff(a, b map[string]string) []string {
	var changed []string
	for _, k := range slices.Sorted(maps.Keys(a)) {
		if v, ok := b[k]; !ok || v != a[k] {
			changed = append(changed, k)
		}
	}
	for _, k := range slices.Sorted(maps.Keys(b)) {
		if _, ok := a[k]; !ok {
			changed = append(changed, k)
		}
	}
	return changed
}
