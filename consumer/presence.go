package consumer

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// Presence: a consumer that dies is found by the others within a second,
// not when its leases run out (PartitionLease).
//
// Each consumer keeps one connection of its own open to the Redis node of
// the group's members key, named after its process token
// (presenceName): Redis closes it the moment the process dies, and CLIENT
// LIST on that node then no longer shows it. Every presenceEvery the others
// look: a member whose connection is still missing presenceEvery after a
// look first missed it is dead,
// and the one that finds it ends its membership and gives its partition
// leases and name back (bury), so that the partitions' new owners take them,
// and the entries it read and never acknowledged (their takeover, work), at
// once.
//
// A consumer that stalled with its connections open (a process stopped,
// paused or swapped out, or a link gone half-open) is what Redis cannot see:
// its heartbeat shows it instead. Every live consumer renews its membership
// every presenceEvery, on a goroutine of its own (heartbeat), which moves
// its score in the members key forward; a member whose score has not moved
// for stallAfter is buried as a dead one is. Woken, a stalled consumer finds
// its partitions taken (its effects fenced by their new leases), writes its
// membership back and rejoins. What neither can see still waits for the
// leases. A consumer whose client cannot hold
// a connection of its own (neither *redis.Client nor *redis.ClusterClient)
// says so in its token (no presencePrefix) and is never taken for dead by
// presence; one whose user may not run CLIENT LIST finds no one dead.

// presenceEvery is how often a consumer looks for dead members (and renews
// its membership).
const presenceEvery = 250 * time.Millisecond

// stallAfter: a member whose membership score has not moved for this long
// (four heartbeats missed), and still has not at a second look presenceEvery
// later, stalled. A second keeps the takeover, with the looks and the new
// owner's first read, under the 2 s an event may wait
// (TestStalledConsumerIsTakenOverWithinASecond: 1.73 s at most).
const stallAfter = time.Second

// presencePrefix starts the process token of a consumer that keeps a
// presence connection.
const presencePrefix = "p-"

// presenceName is the client name of the presence connection of the process
// with token.
func presenceName(token string) string { return "outbox-consumer-" + token }

type presence struct {
	g      *coordination
	conn   *redis.Conn          // the named connection; nil until opened
	node   *redis.Client        // where the members key lives: the connection and CLIENT LIST go there
	absent map[string]time.Time // members found missing, since when
	denied bool                 // CLIENT LIST refused: look no more
	beats  map[string]beat      // members' membership scores, and since when each is unchanged
}

// beat is a member's membership score, when this consumer first saw it, and
// when it first found it unchanged for stallAfter (zero: not yet).
type beat struct {
	score   string
	since   time.Time
	suspect time.Time
}

// presenceCapable: rdb can hold a connection of its own.
func presenceCapable(rdb redis.Cmdable) bool {
	switch rdb.(type) {
	case *redis.Client, *redis.ClusterClient:
		return true
	}
	return false
}

// open (re)opens the named connection if it is not open and working.
func (p *presence) open(ctx context.Context) error {
	if !strings.HasPrefix(p.g.token, presencePrefix) {
		return nil
	}
	client, err := p.g.membersNode(ctx)
	if err != nil {
		return err
	}
	if p.conn != nil {
		// Still on the members key's node (a cluster may have moved it)
		// and answering: nothing to do.
		if client == p.node {
			if err := p.conn.Ping(ctx).Err(); err == nil {
				return nil
			}
		}
		_ = p.conn.Close()
		p.conn, p.node = nil, nil
	}
	conn := client.EphemeralConn()
	if err := conn.ClientSetName(ctx, presenceName(p.g.token)).Err(); err != nil {
		_ = conn.Close()
		return err
	}
	p.conn, p.node = conn, client
	return nil
}

// membersNode is the client of the Redis node of the group's members key
// (rdb must be presence-capable).
func (g *coordination) membersNode(ctx context.Context) (*redis.Client, error) {
	switch rdb := g.rdb.(type) {
	case *redis.Client:
		return rdb, nil
	case *redis.ClusterClient:
		return rdb.MasterForKey(ctx, g.keys.Members(g.cfg.Group))
	}
	return nil, errors.New("no presence with this Redis client")
}

// connectedNames returns the client names connected to node.
func connectedNames(ctx context.Context, node redis.Cmdable) (map[string]bool, error) {
	list, err := node.ClientList(ctx).Result()
	if err != nil {
		return nil, err
	}
	connected := map[string]bool{}
	for line := range strings.SplitSeq(list, "\n") {
		for field := range strings.FieldsSeq(line) {
			if name, ok := strings.CutPrefix(field, "name="); ok && name != "" {
				connected[name] = true
			}
		}
	}
	return connected, nil
}

// holderGone reports whether the process with token, which holds this
// consumer's name, is dead: it keeps a presence connection (its token says
// so) and that connection was missing at two looks presenceEvery apart. A
// consumer restarted under its name then takes the name at once instead of
// waiting for the dead one's lease to run out.
func (g *coordination) holderGone(ctx context.Context, token string) bool {
	if !strings.HasPrefix(token, presencePrefix) || !presenceCapable(g.rdb) {
		return false
	}
	node, err := g.membersNode(ctx)
	if err != nil {
		return false
	}
	for look := 0; look < 2; look++ {
		if look > 0 {
			t := time.NewTimer(presenceEvery)
			select {
			case <-ctx.Done():
				t.Stop()
				return false
			case <-t.C:
			}
		}
		connected, err := connectedNames(ctx, node)
		if err != nil || connected[presenceName(token)] {
			return false
		}
	}
	return true
}

func (p *presence) close() {
	if p.conn != nil {
		_ = p.conn.Close()
		p.conn = nil
	}
}

// look finds the members (other than this consumer) that are dead or
// stalled and buries them; it reports whether it buried any. scores are the
// members' membership scores.
func (p *presence) look(ctx context.Context, members []string, scores map[string]string) bool {
	if len(members) < 2 {
		return false
	}
	if p.lookStalled(ctx, members, scores) {
		return true
	}
	if p.denied || p.node == nil {
		return false
	}
	connected, err := connectedNames(ctx, p.node)
	if err != nil {
		if redis.HasErrorPrefix(err, "NOPERM") || redis.HasErrorPrefix(err, "ERR unknown command") {
			p.denied = true
			p.g.log.Warn("CLIENT LIST is refused: a dead consumer's partitions move only when its leases run out",
				slog.Any("error", err), slog.Duration("partition_lease", p.g.cfg.PartitionLease))
		}
		return false
	}
	buried := false
	seen := map[string]bool{}
	for _, m := range members {
		if m == p.g.cfg.Consumer {
			continue
		}
		seen[m] = true
		token, err := p.g.rdb.Get(ctx, p.g.keys.Consumer(p.g.cfg.Group, m)).Result()
		switch {
		case errors.Is(err, redis.Nil):
			// No name lease: it stopped (or its lease ran out). Its
			// membership runs out by itself.
			delete(p.absent, m)
			continue
		case err != nil:
			return buried
		case !strings.HasPrefix(token, presencePrefix) || connected[presenceName(token)]:
			delete(p.absent, m)
			continue
		}
		// A reconnecting presence connection is missing for a moment:
		// dead only when still missing presenceEvery after it was first
		// found missing.
		since, seenBefore := p.absent[m]
		if !seenBefore {
			p.absent[m] = time.Now()
			continue
		}
		if time.Since(since) < presenceEvery {
			continue
		}
		delete(p.absent, m)
		if p.bury(ctx, m, token, "") {
			buried = true
		}
	}
	for m := range p.absent {
		if !seen[m] {
			delete(p.absent, m)
		}
	}
	return buried
}

// bury ends dead member m's membership (its process token token) and gives
// back its partition leases and its name; it reports whether it did. why
// says why a live process is buried (it stalled); "" for a dead one. An
// empty token (a stalled member whose name lease ran out) matches the
// leases held under m's name by any process.
func (p *presence) bury(ctx context.Context, m, token, why string) bool {
	c := p.g
	holder := m + "|" + token
	freed := 0
	for _, pt := range c.parts {
		key := pt.keys.Lease(c.cfg.Group)
		v, err := c.rdb.Get(ctx, key).Result()
		if err != nil {
			continue
		}
		_, held, ok := strings.Cut(v, "|")
		if ok && token == "" { // its name lease ran out: its leases by its name
			held, _, _ = strings.Cut(held, "|")
			held += "|"
		}
		if ok && held == holder {
			if n, err := releaseScript.Run(ctx, c.rdb, []string{key}, v).Int(); err == nil && n > 0 {
				freed++
			}
		}
	}
	if err := c.rdb.ZRem(ctx, c.keys.Members(c.cfg.Group), m).Err(); err != nil {
		return false
	}
	if token != "" {
		_ = releaseScript.Run(ctx, c.rdb, []string{c.keys.Consumer(c.cfg.Group, m)}, token).Err()
	}
	if why == "" {
		c.log.Warn("consumer died (its connection to Redis is gone): its partitions move now",
			slog.String("dead", m), slog.Int("leases_freed", freed))
	} else {
		c.log.Warn("consumer stalled ("+why+"): its partitions move now; woken, it rejoins",
			slog.String("stalled", m), slog.Int("leases_freed", freed))
	}
	c.cfg.Metrics.takeover()
	return true
}

// lookStalled buries the members whose membership score has not moved for
// stallAfter; it reports whether it buried any.
func (p *presence) lookStalled(ctx context.Context, members []string, scores map[string]string) bool {
	if p.beats == nil {
		p.beats = map[string]beat{}
	}
	now := time.Now()
	buried := false
	for _, m := range members {
		if m == p.g.cfg.Consumer {
			continue
		}
		b, ok := p.beats[m]
		if !ok || b.score != scores[m] {
			p.beats[m] = beat{score: scores[m], since: now}
			continue
		}
		if now.Sub(b.since) < stallAfter {
			continue
		}
		// Still unchanged at a second look, presenceEvery after the first
		// that found it so: Redis itself may have paused (a fork, a slow
		// command), queueing every member's heartbeat behind this look.
		if b.suspect.IsZero() {
			b.suspect = now
			p.beats[m] = b
			continue
		}
		if now.Sub(b.suspect) < presenceEvery {
			continue
		}
		delete(p.beats, m)
		// Its name lease may have run out during the stall (it lasts
		// 3 × Block + 1 s): then its partition leases are known by its name
		// alone.
		token, err := p.g.rdb.Get(ctx, p.g.keys.Consumer(p.g.cfg.Group, m)).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			continue
		}
		if p.bury(ctx, m, token, "its heartbeat stopped for "+stallAfter.String()+", its connections open") {
			buried = true
		}
	}
	for m := range p.beats {
		if !slices.Contains(members, m) {
			delete(p.beats, m)
		}
	}
	return buried
}
