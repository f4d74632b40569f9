package consumer

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// GroupState is what the consumers of a group say in Redis about
// themselves, whatever the source (Redis Streams or NATS JetStream): who is a
// member, who is alive, and who holds each partition. Inspect reads it; it
// is what 'outbox status' shows and judges.
type GroupState struct {
	// Members is every consumer in the group's members set, sorted by name.
	Members []Member
	// Partitions is each partition's lease, by partition number.
	Partitions []PartitionOwner
	// Presence: the presence connections could be read (CLIENT LIST). When
	// they could not (a Redis user without the right, a client that holds
	// no connection of its own), a member is alive while its membership
	// runs, as the consumers themselves judge it.
	Presence bool
}

// Member is one consumer of a group.
type Member struct {
	Name string
	// Alive: its membership runs (it renews it several times a second) and,
	// where presence can be read, its presence connection is open. A
	// consumer killed is not alive at once; one stalled with its
	// connections open stays alive until the others bury it (about a
	// second) or its membership ends (PartitionLease).
	Alive bool
	// Until is how long its membership runs without a renewal (negative:
	// ended, not yet removed).
	Until time.Duration
}

// PartitionOwner is a partition's lease in a group.
type PartitionOwner struct {
	Partition int
	Owner     string        // the consumer holding the lease; "" when none does
	Alive     bool          // the owner's process is alive (as for Member.Alive)
	LeaseLeft time.Duration // how long the lease runs without a renewal
}

// Inspect reads the state of group's consumers from keys (the group's keys,
// with Keys.Partitions set) without changing anything: a consumer of its own
// or an operator's tool may call it at any time.
func Inspect(ctx context.Context, rdb redis.Cmdable, keys Keys, group string) (GroupState, error) {
	var st GroupState
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		return st, fmt.Errorf("read the Redis server's time: %w", err)
	}
	zs, err := rdb.ZRangeWithScores(ctx, keys.Members(group), 0, -1).Result()
	if err != nil {
		return st, fmt.Errorf("read the members of group %s: %w", group, err)
	}
	tokens := map[string]string{} // member name -> the process token holding its name
	for _, z := range zs {
		name, _ := z.Member.(string)
		until := time.UnixMilli(int64(z.Score)).Sub(now)
		st.Members = append(st.Members, Member{Name: name, Alive: until > 0, Until: until})
		tok, err := rdb.Get(ctx, keys.Consumer(group, name)).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			return st, fmt.Errorf("read the name lease of consumer %s: %w", name, err)
		}
		tokens[name] = tok
	}
	slices.SortFunc(st.Members, func(a, b Member) int { return strings.Compare(a.Name, b.Name) })

	holders := make([]string, len(keys.Each())) // each partition's owner's process token, from its lease
	for p, k := range keys.Each() {
		po := PartitionOwner{Partition: p}
		v, err := rdb.Get(ctx, k.Lease(group)).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			return st, fmt.Errorf("read the lease of partition %d: %w", p, err)
		}
		if name, token, ok := parseLease(v); ok {
			po.Owner = name
			holders[p] = token
			left, err := rdb.PTTL(ctx, k.Lease(group)).Result()
			if err != nil {
				return st, fmt.Errorf("read the lease of partition %d: %w", p, err)
			}
			po.LeaseLeft = max(left, 0)
		}
		st.Partitions = append(st.Partitions, po)
	}

	// Presence: a process whose token says it keeps a presence connection
	// is dead when that connection is missing at two looks presenceEvery
	// apart (the consumers' own rule, presence.go).
	var all []string
	for _, t := range tokens {
		all = append(all, t)
	}
	for _, t := range holders {
		if t != "" {
			all = append(all, t)
		}
	}
	gone, known := tokensGone(ctx, rdb, keys.Members(group), all)
	st.Presence = known
	live := map[string]bool{}
	for i, m := range st.Members {
		if gone[tokens[m.Name]] {
			st.Members[i].Alive = false
		}
		live[m.Name] = st.Members[i].Alive
	}
	for i, po := range st.Partitions {
		if po.Owner == "" || gone[holders[i]] {
			continue
		}
		alive, seen := live[po.Owner]
		if !seen {
			// Not among the members read above: it may have joined since
			// (the leases were read after the members). Look again.
			score, err := rdb.ZScore(ctx, keys.Members(group), po.Owner).Result()
			if err != nil && !errors.Is(err, redis.Nil) {
				return st, fmt.Errorf("read the members of group %s: %w", group, err)
			}
			alive = err == nil && time.UnixMilli(int64(score)).After(now)
		}
		st.Partitions[i].Alive = alive
	}
	return st, nil
}

// parseLease splits a partition lease's value, "<epoch>|<consumer>|<process
// token>" (ownership.go), into the consumer and the token.
func parseLease(v string) (name, token string, ok bool) {
	_, holder, ok := strings.Cut(v, "|")
	if !ok {
		return "", "", false
	}
	i := strings.LastIndexByte(holder, '|')
	if i < 0 {
		return holder, "", true
	}
	return holder[:i], holder[i+1:], true
}

// tokensGone returns which of the process tokens that keep a presence
// connection have none on the node of membersKey, at two looks
// presenceEvery apart; known is false when the connections could not be
// listed (and then no token is gone).
func tokensGone(ctx context.Context, rdb redis.Cmdable, membersKey string, tokens []string) (gone map[string]bool, known bool) {
	var node redis.Cmdable
	switch c := rdb.(type) {
	case *redis.Client:
		node = c
	case *redis.ClusterClient:
		n, err := c.MasterForKey(ctx, membersKey)
		if err != nil {
			return nil, false
		}
		node = n
	default:
		return nil, false
	}
	gone = map[string]bool{}
	for look := 0; look < 2; look++ {
		connected, err := connectedNames(ctx, node)
		if err != nil {
			return nil, false
		}
		missing := false
		for _, t := range tokens {
			if !strings.HasPrefix(t, presencePrefix) || connected[presenceName(t)] {
				delete(gone, t)
				continue
			}
			if look == 0 || gone[t] {
				gone[t], missing = true, true
			}
		}
		if !missing {
			return map[string]bool{}, true
		}
		if look == 0 {
			t := time.NewTimer(presenceEvery)
			select {
			case <-ctx.Done():
				t.Stop()
				return map[string]bool{}, true
			case <-t.C:
			}
		}
	}
	return gone, true
}
