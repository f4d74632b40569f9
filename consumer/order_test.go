package consumer

import (
	"errors"
	"fmt"
	"testing"
)

// The gate admits an entry only when no entry of its key pending before it
// is left out of the batch; an entry without a key waits for every earlier
// pending entry, and every later entry waits for it.
func TestGateKeepsEachKeysOrder(t *testing.T) {
	d := func(id, key string) delivery { return delivery{id: id, key: key, values: map[string]any{}} }
	for _, tc := range []struct {
		name    string
		pending []delivery // in the gate before the read
		read    []delivery
		want    string
	}{
		{"nothing pending", nil, []delivery{d("1-0", "a"), d("2-0", "b")}, "[true true]"},
		{"a later entry of a pending key", []delivery{d("1-0", "a")}, []delivery{d("2-0", "a"), d("3-0", "b")}, "[false true]"},
		{"the pending entry read again with it", []delivery{d("1-0", "a"), d("2-0", "a")},
			[]delivery{d("1-0", "a"), d("2-0", "a"), d("3-0", "a")}, "[true true true]"},
		{"the pending entry not in the read", []delivery{d("1-0", "a"), d("2-0", "a")},
			[]delivery{d("2-0", "a"), d("3-0", "a")}, "[false false]"},
		{"ids compare as numbers", []delivery{d("9-0", "a")}, []delivery{d("10-0", "a")}, "[false]"},
		{"an earlier entry of a key is not held", []delivery{d("5-0", "a")}, []delivery{d("4-0", "a")}, "[true]"},
		{"an unkeyed read after a pending entry", []delivery{d("1-0", "a")}, []delivery{d("2-0", ""), d("3-0", "b")}, "[false false]"},
		{"a pending unkeyed entry holds every key", []delivery{d("1-0", "")}, []delivery{d("2-0", "b")}, "[false]"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := newGate()
			for _, p := range tc.pending {
				g.pending(p.id, p.key)
			}
			if got := fmt.Sprint(g.admit(tc.read)); got != tc.want {
				t.Fatalf("admitted %s, want %s", got, tc.want)
			}
		})
	}
	g := newGate()
	g.pending("1-0", "a")
	g.pending("2-0", "a")
	g.done("1-0", "a")
	if got := fmt.Sprint(g.admit([]delivery{d("3-0", "a")})); got != "[false]" {
		t.Fatalf("with 2-0 of key a still pending, 3-0 admitted: %s", got)
	}
	g.keep(map[entryID]bool{})
	if !g.empty() {
		t.Fatal("keep of an empty pass left entries in the gate")
	}
}

// Order holds a key after its failure, every message after an unkeyed
// failure, and nothing after an invalid message.
func TestOrderHoldsFailedKeys(t *testing.T) {
	var o Order
	a, b, none := Message{Key: "a"}, Message{Key: "b"}, Message{}
	o.Failed(a, Invalid("bad"))
	if o.Holds(a) {
		t.Fatal("an invalid message held its key")
	}
	o.Failed(a, errors.New("lock timeout"))
	if !o.Holds(a) || o.Holds(b) || !o.Holds(none) {
		t.Fatalf("after a's failure: holds a %v, b %v, unkeyed %v; want true, false, true", o.Holds(a), o.Holds(b), o.Holds(none))
	}
	var p Order
	p.Failed(none, errors.New("down"))
	if !p.Holds(b) {
		t.Fatal("an unkeyed failure did not hold a later message")
	}
	if r := Held(a); !errors.Is(r.Err, ErrHeld) {
		t.Fatalf("Held: %v", r.Err)
	}
}
