package consumer

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisEffect is a Handler for an effect of one's own in Redis, safe by
// construction: its Lua applies one message's effect and nothing else, and
// RedisEffect runs it inside a script that, atomically,
//
//  1. refuses (ErrFenced) when the partition's lease no longer holds the
//     batch's Fence: this consumer lost the partition;
//  2. returns Duplicate when the message's once-marker exists;
//  3. holds the message (ErrHeld) when the message of its key before it in
//     the batch (or any earlier one, for a message without a key) did not
//     take effect: it failed, was held or never ran (an invalid one, to be
//     dead-lettered, holds nothing);
//  4. runs the Lua, then sets the once-marker, with a TTL that outlives
//     every redelivery (DedupeTTL, checked by New).
//
// So the fence, the once-marker and the per-key order cannot be left out
// of an effect written from this doc; RunScripts is the lower level, for
// scripts that apply many messages per call (package fraud's).
//
// The Lua sees its own keys as KEYS and its arguments as ARGV, as a
// script would, and returns a string (the Outcome; nothing: Applied).
// It must do every check before its first write: Redis does not roll a
// script back, so a write before an error stays while the marker is not
// set, and the retry applies it again. An error reply whose text starts
// with "INVALID" (redis.error_reply('INVALID no amount')) marks a message
// that can never be applied: it is dead-lettered. Any other error leaves
// it pending for a retry.
type RedisEffect struct {
	rdb      redis.Cmdable
	script   *redis.Script
	args     func(m Message) (keys []string, args []any, err error)
	ttl      time.Duration
	replicas Replicas
}

// RedisEffectConfig is what a RedisEffect applies.
type RedisEffectConfig struct {
	// Lua is the effect of one message (the body of a function of KEYS
	// and ARGV).
	Lua string
	// Args returns the keys and arguments of m's effect. Each key is
	// named under the partition's prefix (Batch.Keys.Prefix) by
	// RedisEffect, so that on a Redis Cluster it shares the slot of the
	// partition's stream: return "total:" + account, not a full key. An
	// error wrapping ErrInvalid (Invalid) dead-letters the message; any
	// other leaves it pending for a retry.
	Args func(m Message) (keys []string, args []any, err error)
	// DedupeTTL is how long a once-marker lives: longer than any
	// redelivery (Config.CheckDedupeWindow). Default DefaultDedupeTTL.
	DedupeTTL time.Duration
	// Replicas: wait for this many replicas to have the effects (Replicas).
	Replicas Replicas
}

// DefaultDedupeTTL is RedisEffectConfig.DedupeTTL's default: 7 days.
const DefaultDedupeTTL = 7 * 24 * time.Hour

// NewRedisEffect returns the Handler applying cfg's effect in rdb.
func NewRedisEffect(rdb redis.Cmdable, cfg RedisEffectConfig) (*RedisEffect, error) {
	switch {
	case rdb == nil:
		return nil, fmt.Errorf("%w: no Redis client for the effect", ErrConfig)
	case strings.TrimSpace(cfg.Lua) == "":
		return nil, fmt.Errorf("%w: the effect has no Lua", ErrConfig)
	case cfg.Args == nil:
		return nil, fmt.Errorf("%w: the effect has no Args", ErrConfig)
	case cfg.DedupeTTL < 0:
		return nil, fmt.Errorf("%w: dedupe TTL %s: must not be negative", ErrConfig, cfg.DedupeTTL)
	}
	if cfg.DedupeTTL == 0 {
		cfg.DedupeTTL = DefaultDedupeTTL
	}
	return &RedisEffect{rdb: rdb, script: redis.NewScript(effectPrologue + cfg.Lua + effectEpilogue),
		args: cfg.Args, ttl: cfg.DedupeTTL, replicas: cfg.Replicas}, nil
}

// The script around the effect's Lua. KEYS: the partition's lease, the
// message's marker, the batch's record of what took effect, then the
// effect's own keys; ARGV: the fence, the marker's TTL in ms, the message's
// event id, the event ids it must find in the record (a comma list), then
// the effect's own arguments.
const (
	effectPrologue = `
local function tookEffect()
  redis.call('HSET', KEYS[3], ARGV[3], '1')
  redis.call('PEXPIRE', KEYS[3], 60000)
end
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED the partition has another owner')
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  tookEffect()
  return 'duplicate'
end
for dep in string.gmatch(ARGV[4], '[^,]+') do
  if redis.call('HEXISTS', KEYS[3], dep) == 0 then
    return redis.error_reply('HELD an earlier message of its key did not take effect')
  end
end
local keys, argv = {}, {}
for i = 4, #KEYS do keys[#keys + 1] = KEYS[i] end
for i = 5, #ARGV do argv[#argv + 1] = ARGV[i] end
local ok, out = pcall(function(KEYS, ARGV)
`
	effectEpilogue = `
end, keys, argv)
local failed = nil
if not ok then
  failed = out
  if type(out) == 'table' and out.err then failed = out.err end
  failed = tostring(failed)
elseif type(out) == 'table' and out.err then
  failed = out.err
end
if failed then
  if string.sub(failed, 1, 7) == 'INVALID' then
    tookEffect() -- never applicable: dead-lettered, it holds nothing back
  end
  return redis.error_reply(failed)
end
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
tookEffect()
if type(out) ~= 'string' or out == '' then return 'applied' end
return out
`
)

// DedupeTTL is how long the once-markers live (Deduper).
func (e *RedisEffect) DedupeTTL() time.Duration { return e.ttl }

// Marker returns the key of m's once-marker in partition keys k.
func (e *RedisEffect) Marker(k Keys, m Message) string { return k.Prefix + "once:" + m.ID.String() }

// Handle applies b's messages, one script call each, in one pipeline.
func (e *RedisEffect) Handle(ctx context.Context, b Batch) []Result {
	calls, res := e.calls(b)
	replies, errs := RunScripts(ctx, e.rdb, b, calls, e.replicas)
	for i, m := range b.Messages {
		if calls[i].Script == nil {
			continue // Args failed: res[i] has its error
		}
		switch err := errs[i]; {
		case err == nil:
			out, _ := replies[i].Text()
			res[i].Outcome = out
		case redis.HasErrorPrefix(err, "HELD"):
			res[i] = Held(m)
		case redis.HasErrorPrefix(err, "INVALID"):
			res[i].Err = fmt.Errorf("%w: %s", ErrInvalid, strings.TrimSpace(strings.TrimPrefix(err.Error(), "INVALID")))
		case errors.Is(err, ErrFenced):
			res[i].Err = err
		default:
			res[i].Err = fmt.Errorf("effect of event %s: %w", m.ID, err)
		}
	}
	return res
}

// calls returns the script call of each of b's messages, and the results
// of those whose Args failed (they have no call).
func (e *RedisEffect) calls(b Batch) ([]ScriptCall, []Result) {
	res := make([]Result, len(b.Messages))
	// What took effect in this batch, by event id (applied now or before,
	// or never applicable): a fact about each event, so a record left by an
	// earlier delivery of the same batch says nothing untrue.
	var record string
	if len(b.Messages) > 0 {
		record = b.Keys.Prefix + "effect-batch:" + b.Messages[0].ID.String()
	}
	calls := make([]ScriptCall, len(b.Messages))
	lastOfKey := map[string]int{}
	lastKeyless := -1
	invalid := map[int]bool{} // dead-lettered without a call: they hold nothing back
	for i, m := range b.Messages {
		keys, args, err := e.args(m)
		if err != nil {
			res[i].Err = err
		} else {
			// What must have taken effect before m: the message of its key
			// before it and the last one without a key; for a message
			// without a key, every earlier one.
			var deps []string
			if m.Key == "" {
				for j := range i {
					if !invalid[j] {
						deps = append(deps, b.Messages[j].ID.String())
					}
				}
			} else {
				if j, ok := lastOfKey[m.Key]; ok {
					deps = append(deps, b.Messages[j].ID.String())
				}
				if lastKeyless >= 0 {
					deps = append(deps, b.Messages[lastKeyless].ID.String())
				}
			}
			full := make([]string, 0, 3+len(keys))
			full = append(full, b.Keys.Lease(b.Group), e.Marker(b.Keys, m), record)
			for _, k := range keys {
				full = append(full, b.Keys.Prefix+k)
			}
			calls[i] = ScriptCall{Script: e.script, Keys: full,
				Args: append([]any{b.Fence, e.ttl.Milliseconds(), m.ID.String(), strings.Join(deps, ",")}, args...)}
		}
		switch {
		case errors.Is(err, ErrInvalid):
			invalid[i] = true
		case m.Key == "":
			lastKeyless = i
		default:
			lastOfKey[m.Key] = i
		}
	}
	return calls, res
}
