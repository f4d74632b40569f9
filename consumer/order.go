package consumer

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
)

// Per-key order across failures. The relay publishes the events of one
// partition key in commit order; a consumer must apply them in that order
// even when one of them fails for a while (a lock timeout, a store down): a
// sender's TED #2 must not take effect while #1 waits for its retry. Two
// rules keep it:
//
//   - in a batch, the handler applies no message of a key after one of that
//     key failed (Order tracks the failed keys; the later ones are Held);
//   - across batches, the consumer's gate keeps every message of a key that
//     is pending with it (failed, or held) in a list, and hands the handler
//     no later message of that key until the earlier ones are done: they
//     stay pending, and are read again, in stream order, with the retry.
//
// A message without a key (an entry written before relays wrote one) is
// ordered after every earlier message of the partition and before every
// later one. A message that can never be applied (ErrInvalid) holds nothing
// back: it is dead-lettered, not retried into place.

// ErrHeld is wrapped by the error of a message left pending, not applied,
// because an earlier message of its key failed: it is delivered again after
// that one.
var ErrHeld = errors.New("held behind an earlier message of its key")

// Held returns the Result of a message held behind an earlier message of its
// key that failed.
func Held(m Message) Result {
	key := m.Key
	if key == "" {
		key = "(none)"
	}
	return Result{Err: fmt.Errorf("%w: event %s, key %s", ErrHeld, m.ID, key)}
}

// Order tracks, within one batch, the keys with a message that failed, so
// that a handler applying a batch message by message holds the later ones
// of those keys back. The zero value holds nothing.
type Order struct {
	failed map[string]bool
	all    bool // a message without a key failed: it holds every later one
}

// Holds reports whether m must be held: an earlier message of its key (or
// one without a key) failed, or m has no key and any earlier message failed.
func (o *Order) Holds(m Message) bool {
	switch {
	case o.all:
		return true
	case m.Key == "":
		return len(o.failed) > 0
	default:
		return o.failed[m.Key]
	}
}

// Failed records that m failed (or was held): the later messages of its key
// must be held. A message that can never be applied (ErrInvalid) holds
// nothing back, so err wrapping ErrInvalid records nothing.
func (o *Order) Failed(m Message, err error) {
	if err == nil || errors.Is(err, ErrInvalid) {
		return
	}
	if m.Key == "" {
		o.all = true
		return
	}
	if o.failed == nil {
		o.failed = map[string]bool{}
	}
	o.failed[m.Key] = true
}

// gate is a partition's per-key order across reads (Redis Streams): the
// entries of each key pending with this consumer after a failure, in stream
// order. Only the goroutine applying the partition uses it.
type gate struct {
	byKey   map[string][]entryID // pending entries with a key, by key
	unkeyed []entryID            // pending entries without one
	// invalid are entries left pending as invalid until their last
	// delivery: they hold nothing back, but this worker knows them.
	invalid map[entryID]bool
}

func newGate() *gate { return &gate{byKey: map[string][]entryID{}, invalid: map[entryID]bool{}} }

// knows reports whether this worker left the entry pending itself (failed,
// held or invalid), as opposed to one another process read.
func (g *gate) knows(id string) bool {
	if g == nil {
		return false
	}
	e := parseEntryID(id)
	if g.invalid[e] {
		return true
	}
	if _, found := slices.BinarySearchFunc(g.unkeyed, e, entryID.compare); found {
		return true
	}
	for _, l := range g.byKey {
		if _, found := slices.BinarySearchFunc(l, e, entryID.compare); found {
			return true
		}
	}
	return false
}

// invalidPending records an entry left pending as invalid (ErrInvalid, or
// one that does not decode) until its last delivery.
func (g *gate) invalidPending(id, key string) {
	if g == nil {
		return
	}
	g.done(id, key)
	g.invalid[parseEntryID(id)] = true
}

// admit reports which of ds, read in stream order, may reach the handler:
// those with no pending entry of their key (or, without a key, of any key;
// or an unkeyed one) before them, other than ones admitted in this batch.
func (g *gate) admit(ds []delivery) []bool {
	ok := make([]bool, len(ds))
	if g == nil || g.empty() {
		for i := range ok {
			ok[i] = true
		}
		return ok
	}
	admitted := map[entryID]bool{}
	clear := func(id entryID, pending []entryID) bool {
		for _, p := range pending {
			if p.compare(id) >= 0 {
				break
			}
			if !admitted[p] {
				return false
			}
		}
		return true
	}
	heldAll := false // an unkeyed entry of this batch was held: so is every later one
	for i, d := range ds {
		id := parseEntryID(d.id)
		free := !heldAll && clear(id, g.unkeyed)
		if d.key == "" {
			for _, pending := range g.byKey {
				free = free && clear(id, pending)
			}
		} else {
			free = free && clear(id, g.byKey[d.key])
		}
		if free {
			admitted[id] = true
		} else if d.key == "" {
			heldAll = true
		}
		ok[i] = free
	}
	return ok
}

// pending records that the entry stays pending (failed or held): later
// entries of its key wait for it.
func (g *gate) pending(id, key string) {
	if g == nil {
		return
	}
	e := parseEntryID(id)
	list := &g.unkeyed
	if key != "" {
		l := g.byKey[key]
		list = &l
		defer func() { g.byKey[key] = *list }()
	}
	i, found := slices.BinarySearchFunc(*list, e, entryID.compare)
	if !found {
		*list = slices.Insert(*list, i, e)
	}
}

// done records that the entry is no longer pending (applied, a duplicate,
// dead-lettered, trimmed).
func (g *gate) done(id, key string) {
	if g == nil || g.empty() {
		return
	}
	e := parseEntryID(id)
	if key == "" {
		if i, found := slices.BinarySearchFunc(g.unkeyed, e, entryID.compare); found {
			g.unkeyed = slices.Delete(g.unkeyed, i, i+1)
		}
		return
	}
	l := g.byKey[key]
	if i, found := slices.BinarySearchFunc(l, e, entryID.compare); found {
		l = slices.Delete(l, i, i+1)
	}
	if len(l) == 0 {
		delete(g.byKey, key)
	} else {
		g.byKey[key] = l
	}
}

// keep forgets every entry not in seen: after a full pass over this
// consumer's pending entries, the ones it did not meet are pending no more
// (acknowledged elsewhere, claimed by another consumer).
func (g *gate) keep(seen map[entryID]bool) {
	if g == nil {
		return
	}
	g.unkeyed = slices.DeleteFunc(g.unkeyed, func(e entryID) bool { return !seen[e] })
	maps.DeleteFunc(g.invalid, func(e entryID, _ bool) bool { return !seen[e] })
	for k, l := range g.byKey {
		if l = slices.DeleteFunc(l, func(e entryID) bool { return !seen[e] }); len(l) == 0 {
			delete(g.byKey, k)
		} else {
			g.byKey[k] = l
		}
	}
}

// empty reports whether no entry of the gate holds another back.
func (g *gate) empty() bool { return g == nil || (len(g.byKey) == 0 && len(g.unkeyed) == 0) }

// entryID is a Redis stream entry id, <ms>-<seq>, as numbers.
type entryID struct{ ms, seq uint64 }

func parseEntryID(s string) entryID {
	ms, seq, _ := strings.Cut(s, "-")
	var e entryID
	e.ms, _ = strconv.ParseUint(ms, 10, 64)
	e.seq, _ = strconv.ParseUint(seq, 10, 64)
	return e
}

func (e entryID) compare(o entryID) int {
	return cmp.Or(cmp.Compare(e.ms, o.ms), cmp.Compare(e.seq, o.seq))
}
