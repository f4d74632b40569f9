package consumer

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/outboxtest"
)

// totalsEffect adds each message's amount (its payload, a number) to its
// aggregate's total and logs the event in one list: the effect of a team's
// own, written as its Lua only. A payload "fail" fails in the Lua after
// its checks, "invalid" is refused as never applicable, "bad-args" before
// the script.
func totalsEffect(t *testing.T, rdb outboxtest.Redis) *RedisEffect {
	t.Helper()
	e, err := NewRedisEffect(rdb.Client, RedisEffectConfig{
		Lua: `
if ARGV[2] == 'fail' then return redis.error_reply('ERR the effect failed') end
if ARGV[2] == 'invalid' then return redis.error_reply('INVALID not an amount') end
redis.call('INCRBY', KEYS[1], tonumber(ARGV[2]))
redis.call('RPUSH', KEYS[2], ARGV[1])
return 'added'`,
		Args: func(m Message) ([]string, []any, error) {
			if string(m.Payload) == "bad-args" {
				return nil, nil, Invalid("payload %q", m.Payload)
			}
			amount := string(m.Payload)
			if strings.HasPrefix(amount, "{") {
				amount = "1" // an entry of the consumer's tests: {"n":1}
			}
			return []string{"total:" + m.AggregateID, "log"}, []any{m.AggregateID + "/" + m.ID.String()[:4], amount}, nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func msg(agg, key, payload string) Message {
	return Message{ID: uuid.New(), AggregateID: agg, Key: key, Payload: []byte(payload)}
}

func outcomes(res []Result) string {
	var s []string
	for _, r := range res {
		switch {
		case r.Err == nil:
			s = append(s, r.Outcome)
		case errors.Is(r.Err, ErrFenced):
			s = append(s, "fenced")
		case errors.Is(r.Err, ErrHeld):
			s = append(s, "held")
		case errors.Is(r.Err, ErrInvalid):
			s = append(s, "invalid")
		default:
			s = append(s, "failed")
		}
	}
	return strings.Join(s, " ")
}

// A Redis effect written as its Lua alone is fenced, applied once and keeps
// each key's order: the library adds what it must not forget.
func TestRedisEffectIsFencedOnceAndInOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb := outboxtest.NewRedis(t)
	e := totalsEffect(t, rdb)
	keys := Keys{Prefix: rdb.Prefix + "p0:"}
	lease := keys.Lease("g")
	if err := rdb.Set(ctx, lease, "7|c1|x", 0).Err(); err != nil {
		t.Fatal(err)
	}
	batch := func(fence string, ms ...Message) Batch {
		return Batch{Stream: rdb.Prefix + "stream", Keys: keys, Fence: fence, Group: "g", Messages: ms}
	}
	total := func(agg string) int {
		n, _ := rdb.Get(ctx, keys.Prefix+"total:"+agg).Int()
		return n
	}
	logged := func() string {
		l, _ := rdb.LRange(ctx, keys.Prefix+"log", 0, -1).Result()
		return strings.Join(l, ",")
	}

	a1, b1, a2 := msg("a", "a", "1"), msg("b", "b", "10"), msg("a", "a", "2")
	if got := outcomes(e.Handle(ctx, batch("7|c1|x", a1, b1, a2))); got != "added added added" {
		t.Fatalf("a first batch: %s", got)
	}
	if got := outcomes(e.Handle(ctx, batch("7|c1|x", a1, b1, a2))); got != "duplicate duplicate duplicate" {
		t.Fatalf("the same batch again: %s", got)
	}
	if total("a") != 3 || total("b") != 10 {
		t.Fatalf("totals a %d, b %d after a batch applied twice, want 3 and 10", total("a"), total("b"))
	}

	// Fenced: the lease moved to another owner.
	a3 := msg("a", "a", "100")
	if got := outcomes(e.Handle(ctx, batch("6|c0|y", a3))); got != "fenced" {
		t.Fatalf("a batch of a lost partition: %s", got)
	}
	if total("a") != 3 {
		t.Fatalf("a fenced batch wrote: total a %d", total("a"))
	}

	// A failure holds its key's later messages, not the other keys'; a
	// message without a key waits for every earlier one.
	a4, c1, a5, none := msg("a", "a", "fail"), msg("c", "c", "5"), msg("a", "a", "4"), msg("n", "", "1")
	if got := outcomes(e.Handle(ctx, batch("7|c1|x", a4, c1, a5, none))); got != "failed added held held" {
		t.Fatalf("a failing message: %s", got)
	}
	if total("a") != 3 || total("c") != 5 || total("n") != 0 {
		t.Fatalf("after a failure: a %d c %d n %d, want 3 5 0", total("a"), total("c"), total("n"))
	}
	// Delivered again, in order, once the failure is gone.
	a4.Payload = []byte("8")
	if got := outcomes(e.Handle(ctx, batch("7|c1|x", a4, a5, none))); got != "added added added" {
		t.Fatalf("the failed and held messages again: %s", got)
	}
	if total("a") != 15 || total("n") != 1 {
		t.Fatalf("totals a %d n %d, want 15 1", total("a"), total("n"))
	}

	// Never applicable (refused by the Lua, or by Args): dead-lettered, it
	// holds nothing back.
	d1, d2, d3 := msg("d", "d", "invalid"), msg("d", "d", "bad-args"), msg("d", "d", "2")
	if got := outcomes(e.Handle(ctx, batch("7|c1|x", d1, d2, d3))); got != "invalid invalid added" {
		t.Fatalf("invalid messages: %s", got)
	}
	if total("d") != 2 {
		t.Fatalf("total d %d, want 2", total("d"))
	}
	want := []string{"a/" + a1.ID.String()[:4], "b/" + b1.ID.String()[:4], "a/" + a2.ID.String()[:4], "c/" + c1.ID.String()[:4],
		"a/" + a4.ID.String()[:4], "a/" + a5.ID.String()[:4], "n/" + none.ID.String()[:4], "d/" + d3.ID.String()[:4]}
	if got := logged(); got != strings.Join(want, ",") {
		t.Fatalf("effects in the order\n%s\nwant\n%s", got, strings.Join(want, ","))
	}
	// Every key the effect wrote is under the partition's prefix: on a
	// Redis Cluster, in the slot of its stream.
	written, err := rdb.Keys(ctx, rdb.Prefix+"*").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range written {
		if !strings.HasPrefix(k, keys.Prefix) {
			t.Errorf("key %s is outside the partition's prefix %s", k, keys.Prefix)
		}
	}
	if ttl := rdb.PTTL(ctx, e.Marker(keys, a1)).Val(); ttl < DefaultDedupeTTL-time.Minute {
		t.Fatalf("once-marker TTL %s, want %s", ttl, DefaultDedupeTTL)
	}
}

// A consumer applies a RedisEffect to its stream: each event once, a
// duplicate delivery skipped.
func TestRedisEffectUnderAConsumer(t *testing.T) {
	t.Parallel()
	rdb := outboxtest.NewRedis(t)
	e := totalsEffect(t, rdb)
	cfg := testConfig(rdb, "c1")
	c := newGroupConsumer(t, rdb, e, cfg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	for range 5 {
		publishKeyed(t, rdb, cfg.Stream, "acct", "acct")
	}
	outboxtest.Eventually(t, 10*time.Second, func() bool { return c.Stats().Processed == 5 }, "the effects were not applied: %+v", c.Stats())
	n, err := rdb.Get(context.Background(), cfg.KeyPrefix+"total:acct").Int()
	if err != nil || n != 5 {
		t.Fatalf("total %d (%v), want 5: each event once", n, err)
	}
}

func TestRedisEffectConfig(t *testing.T) {
	t.Parallel()
	rdb := outboxtest.NewRedis(t)
	args := func(Message) ([]string, []any, error) { return nil, nil, nil }
	for name, cfg := range map[string]RedisEffectConfig{
		"no Lua":       {Args: args},
		"no Args":      {Lua: "return 'x'"},
		"negative TTL": {Lua: "return 'x'", Args: args, DedupeTTL: -time.Second},
	} {
		if _, err := NewRedisEffect(rdb.Client, cfg); !errors.Is(err, ErrConfig) {
			t.Errorf("%s: %v, want ErrConfig", name, err)
		}
	}
}

// CheckScript finds what a hand-written effect script forgot (the fence,
// the once-marker, checks before writes), and passes a RedisEffect's.
func TestCheckScriptFindsWhatAScriptForgot(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rdb := outboxtest.NewRedis(t)
	e := totalsEffect(t, rdb)
	// KEYS: lease, marker, total; ARGV: fence.
	byHand := func(lua string) func(b Batch) ScriptCall {
		s := redis.NewScript(lua)
		return func(b Batch) ScriptCall {
			m := b.Messages[0]
			return ScriptCall{Script: s, Keys: []string{b.Keys.Lease(b.Group), b.Keys.Prefix + "once:" + m.ID.String(), b.Keys.Prefix + "total"},
				Args: []any{b.Fence}}
		}
	}
	const (
		fence   = "if redis.call('GET', KEYS[1]) ~= ARGV[1] then return redis.error_reply('FENCED lost') end\n"
		once    = "if redis.call('EXISTS', KEYS[2]) == 1 then return 'duplicate' end\n"
		effect  = "redis.call('INCR', KEYS[3])\n"
		marker  = "redis.call('SET', KEYS[2], '1')\nreturn 'applied'\n"
		nothing = "return 'applied'\n"
	)
	for i, c := range []struct {
		name string
		call func(b Batch) ScriptCall
		want string // in the error; "": none
	}{
		{"a RedisEffect", func(b Batch) ScriptCall { calls, _ := e.calls(b); return calls[0] }, ""},
		{"by hand, complete", byHand(fence + once + effect + marker), ""},
		{"without the fence", byHand(once + effect + marker), "fence: a batch whose fence"},
		{"without the once-marker", byHand(fence + effect + nothing), "once: the message applied again"},
		{"writing before its fence", byHand(effect + fence + once + marker), "every check must come before the first write"},
	} {
		keys := Keys{Prefix: rdb.Prefix + strconv.Itoa(i) + ":"}
		err := CheckScript(ctx, rdb.Client, keys, msg("a", "a", "5"), c.call)
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%s: %v, want no error", c.name, err)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
			t.Errorf("%s: %v, want an error saying %q", c.name, err, c.want)
		}
	}
}
