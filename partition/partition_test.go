package partition

import (
	"fmt"
	"testing"
)

// The mapping is a contract: these values must never change, or a
// deployment's senders would move between partitions on an upgrade.
func TestOfIsStable(t *testing.T) {
	for _, c := range []struct {
		key  string
		n, p int
	}{
		// md5("acct-1") starts 14d2b35c = 349352284, the value PostgreSQL
		// gives for (('x' || substr(md5('acct-1'), 1, 8))::bit(32)::bigint).
		{"acct-1", 1, 0}, {"acct-1", 16, 349352284 % 16}, {"acct-1", 1000, 349352284 % 1000},
		{"", 7, 0xd41d8cd9 % 7},
	} {
		if got := Of(c.key, c.n); got != c.p {
			t.Errorf("Of(%q, %d) = %d, want %d", c.key, c.n, got, c.p)
		}
	}
}

// Keys spread over the partitions: no partition of 16 gets less than half or
// more than twice its share of 16,000 keys.
func TestOfSpreads(t *testing.T) {
	const n, keys = 16, 16000
	var count [n]int
	for i := range keys {
		count[Of(fmt.Sprintf("acct-%d", i), n)]++
	}
	for p, c := range count {
		if c < keys/n/2 || c > keys/n*2 {
			t.Errorf("partition %d has %d of %d keys", p, c, keys)
		}
	}
}

func TestSlotFollowsRedisHashTags(t *testing.T) {
	// Values from CLUSTER KEYSLOT on Redis 7.
	for _, c := range []struct {
		key  string
		slot int
	}{
		{"foo", 12182}, {"123456789", 12739}, {"{user1000}.following", Slot("user1000")},
		{"foo{}{bar}", Slot("foo{}{bar}")}, {"{}x", crc16Slot("{}x")}, {"a{b", crc16Slot("a{b")},
	} {
		if got := Slot(c.key); got != c.slot {
			t.Errorf("Slot(%q) = %d, want %d", c.key, got, c.slot)
		}
	}
	if Slot("foo{}{bar}") != crc16Slot("foo{}{bar}") {
		t.Error("an empty first tag must hash the whole key")
	}
}

func crc16Slot(s string) int { return int(crc16(s)) % Slots }

// Each partition's tag lies in its own n-th of the slot space, so the
// partitions spread evenly over masters that own equal contiguous ranges.
func TestTagsSpreadOverTheSlotSpace(t *testing.T) {
	for _, n := range []int{2, 3, 4, 16, 100, Max} {
		seen := map[string]bool{}
		for p := range n {
			tag := Tag(p, n)
			if s := Slot(tag); s < p*Slots/n || s >= (p+1)*Slots/n {
				t.Fatalf("Tag(%d, %d) = %q in slot %d, outside [%d, %d)", p, n, tag, s, p*Slots/n, (p+1)*Slots/n)
			}
			if seen[tag] {
				t.Fatalf("Tag(%d, %d) = %q twice", p, n, tag)
			}
			seen[tag] = true
			if Slot(Stream("outbox.event.transfer", p, n)) != Slot(Prefix("fraud:", p, n)+"seen:x") {
				t.Fatalf("partition %d of %d: stream and state in different slots", p, n)
			}
		}
	}
	if Stream("outbox.event.transfer", 0, 1) != "outbox.event.transfer" || Prefix("fraud:", 0, 1) != "fraud:" {
		t.Error("one partition must keep the plain names")
	}
}
