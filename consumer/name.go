package consumer

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/retry"
)

// ErrNameInUse: another running consumer of the group has this consumer's
// name. Two processes under one name would share one pending list, each
// re-reading and acknowledging the other's entries.
var ErrNameInUse = errors.New("consumer name in use")

// nameLease is how a running consumer holds its name: the key
// Keys.Consumer(group, name) holds a random token of the process and lives
// nameLeaseTTL; the consumer renews it every loop. A consumer that crashed
// leaves it to expire.
func (g *coordination) nameLeaseTTL() time.Duration { return 3*g.cfg.Block + time.Second }

// ensureNameFree takes the name's lease. If another process holds it, it
// watches the lease: one that is renewed (or taken over) belongs to a live
// consumer, and the name is refused; one that only runs down was left by a
// crash, and the name is taken when it expires.
func (g *coordination) ensureNameFree(ctx context.Context) error {
	key := g.keys.Consumer(g.cfg.Group, g.cfg.Consumer)
	inUse := func() error {
		return fmt.Errorf("%w: consumer %q of group %s is running elsewhere (it keeps renewing %s); "+
			"give each consumer its own name (--consumer, or Config.Consumer)",
			ErrNameInUse, g.cfg.Consumer, g.cfg.Group, key)
	}
	var holder string
	var left time.Duration
	for {
		ok, err := g.rdb.SetNX(ctx, key, g.token, g.nameLeaseTTL()).Result()
		if err != nil {
			return fmt.Errorf("take the consumer name %q: %w", g.cfg.Consumer, err)
		}
		if ok {
			g.leaseRenewed = time.Now()
			return nil
		}
		v, verr := g.rdb.Get(ctx, key).Result()
		ttl, terr := g.rdb.PTTL(ctx, key).Result()
		switch {
		case errors.Is(verr, redis.Nil) || ttl == -2*time.Nanosecond:
			continue // expired just now
		case verr != nil || terr != nil:
			return fmt.Errorf("read the consumer name's lease %s: %w", key, errors.Join(verr, terr))
		case ttl < 0:
			return inUse() // no expiry: not a lease a crash could leave behind
		case v != g.token && g.holderGone(ctx, v):
			// Its process is dead (its presence connection is gone):
			// take the name now rather than when the lease runs out.
			_ = releaseScript.Run(ctx, g.rdb, []string{key}, v).Err()
			continue
		case holder != "" && (v != holder || ttl > left+50*time.Millisecond):
			return inUse() // renewed or taken over meanwhile: a live consumer
		}
		holder, left = v, ttl
		retry.Sleep(ctx, min(ttl+10*time.Millisecond, g.cfg.Block/2, time.Second))
		if err := ctx.Err(); err != nil {
			return err
		}
	}
}

// renewScript extends the name's lease if it still holds this process's
// token, takes it back if it expired with nobody taking it, and otherwise
// (another process holds the name) changes nothing and returns 0.
var renewScript = redis.NewScript(`
local v = redis.call('GET', KEYS[1])
if v and v ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1`)

// errNameTaken: another process took this consumer's name while this one
// was away (stalled past the name's lease, cut from Redis).
var errNameTaken = fmt.Errorf("%w: another process took this consumer's name while this one stalled past its lease; "+
	"this one stands down for good (its partitions are the other's now)", ErrNameInUse)

// renewName extends the name's lease if a third of it has passed. If
// another process took the name meanwhile (this one stalled past the TTL
// and a supervisor started a replacement), it returns errNameTaken: two
// processes under one name would share a pending list and take each
// other's partitions, so the one that was away stands down for good.
func (g *coordination) renewName(ctx context.Context) error {
	if time.Since(g.leaseRenewed) < g.nameLeaseTTL()/3 {
		return nil
	}
	key := g.keys.Consumer(g.cfg.Group, g.cfg.Consumer)
	ok, err := renewScript.Run(ctx, g.rdb, []string{key}, g.token, g.nameLeaseTTL().Milliseconds()).Int()
	if err != nil {
		return nil // Redis trouble shows in the read that follows
	}
	if ok == 0 {
		return errNameTaken
	}
	g.leaseRenewed = time.Now()
	return nil
}

// releaseName gives the name back on a clean stop, so a successor need not
// wait for the lease to expire.
func (g *coordination) releaseName() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	key := g.keys.Consumer(g.cfg.Group, g.cfg.Consumer)
	if v, err := g.rdb.Get(ctx, key).Result(); err == nil && v == g.token {
		g.rdb.Del(ctx, key)
	}
}
