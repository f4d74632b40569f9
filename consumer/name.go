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
func (c *Consumer) nameLeaseTTL() time.Duration { return 3*c.cfg.Block + time.Second }

// ensureNameFree takes the name's lease. If another process holds it, it
// watches the lease: one that is renewed (or taken over) belongs to a live
// consumer, and the name is refused; one that only runs down was left by a
// crash, and the name is taken when it expires.
func (c *Consumer) ensureNameFree(ctx context.Context) error {
	key := c.keys.Consumer(c.cfg.Group, c.cfg.Consumer)
	inUse := func() error {
		return fmt.Errorf("%w: consumer %q of group %s is running elsewhere (it keeps renewing %s); "+
			"give each consumer its own name (--consumer, or Config.Consumer)",
			ErrNameInUse, c.cfg.Consumer, c.cfg.Group, key)
	}
	var holder string
	var left time.Duration
	for {
		ok, err := c.rdb.SetNX(ctx, key, c.token, c.nameLeaseTTL()).Result()
		if err != nil {
			return fmt.Errorf("take the consumer name %q: %w", c.cfg.Consumer, err)
		}
		if ok {
			c.leaseRenewed = time.Now()
			return nil
		}
		v, verr := c.rdb.Get(ctx, key).Result()
		ttl, terr := c.rdb.PTTL(ctx, key).Result()
		switch {
		case errors.Is(verr, redis.Nil) || ttl == -2*time.Nanosecond:
			continue // expired just now
		case verr != nil || terr != nil:
			return fmt.Errorf("read the consumer name's lease %s: %w", key, errors.Join(verr, terr))
		case ttl < 0:
			return inUse() // no expiry: not a lease a crash could leave behind
		case v != c.token && c.holderGone(ctx, v):
			// Its process is dead (its presence connection is gone):
			// take the name now rather than when the lease runs out.
			_ = releaseScript.Run(ctx, c.rdb, []string{key}, v).Err()
			continue
		case holder != "" && (v != holder || ttl > left+50*time.Millisecond):
			return inUse() // renewed or taken over meanwhile: a live consumer
		}
		holder, left = v, ttl
		retry.Sleep(ctx, min(ttl+10*time.Millisecond, c.cfg.Block/2, time.Second))
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
func (c *Consumer) renewName(ctx context.Context) error {
	if time.Since(c.leaseRenewed) < c.nameLeaseTTL()/3 {
		return nil
	}
	key := c.keys.Consumer(c.cfg.Group, c.cfg.Consumer)
	ok, err := renewScript.Run(ctx, c.rdb, []string{key}, c.token, c.nameLeaseTTL().Milliseconds()).Int()
	if err != nil {
		return nil // Redis trouble shows in the read that follows
	}
	if ok == 0 {
		return errNameTaken
	}
	c.leaseRenewed = time.Now()
	return nil
}

// releaseName gives the name back on a clean stop, so a successor need not
// wait for the lease to expire.
func (c *Consumer) releaseName() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	key := c.keys.Consumer(c.cfg.Group, c.cfg.Consumer)
	if v, err := c.rdb.Get(ctx, key).Result(); err == nil && v == c.token {
		c.rdb.Del(ctx, key)
	}
}
