package settled_test

import (
	"encoding/json"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/tedbank/outbox/transfer/settled"
)

// A payload encoded from Payload decodes to the same; one field out of the
// rules makes Decode fail with ErrInvalid.
func TestDecode(t *testing.T) {
	p := settled.Payload{SchemaVersion: settled.Version, EventID: uuid.New(), TransferID: uuid.New(),
		FromAccount: "ana", ToAccount: "bia", AmountCents: 100, Currency: "BRL", SettledAt: time.Now().UTC()}
	b, err := json.Marshal(p)
	if err != nil {
		t.Fatal(err)
	}
	got, err := settled.Decode(b)
	if err != nil || !got.SettledAt.Equal(p.SettledAt) || got.EventID != p.EventID || got.AmountCents != 100 {
		t.Fatalf("Decode(%s) = %+v, %v", b, got, err)
	}
	for name, bad := range map[string]func(*settled.Payload){
		"version":  func(p *settled.Payload) { p.SchemaVersion = settled.Version + 1 },
		"currency": func(p *settled.Payload) { p.Currency = "XXX" },
		"amount":   func(p *settled.Payload) { p.AmountCents = settled.MaxAmountCents + 1 },
		"account":  func(p *settled.Payload) { p.FromAccount = "" },
	} {
		q := p
		bad(&q)
		b, _ := json.Marshal(q)
		if _, err := settled.Decode(b); !errors.Is(err, settled.ErrInvalid) {
			t.Errorf("%s: Decode = %v, want ErrInvalid", name, err)
		}
	}
}

// Currencies is sorted (IsCurrency searches it) and a copy.
func TestCurrencies(t *testing.T) {
	cs := settled.Currencies()
	if !slices.IsSorted(cs) || !settled.IsCurrency("BRL") || settled.IsCurrency("brl") {
		t.Fatalf("currencies %v", cs)
	}
	cs[0] = "ZZZ"
	if settled.Currencies()[0] == "ZZZ" {
		t.Fatal("Currencies returned its own slice")
	}
}

// BenchmarkDecode: a consumer decodes every event it applies (go test -bench
// Decode ./transfer/settled).
func BenchmarkDecode(b *testing.B) {
	p, err := json.Marshal(settled.Payload{SchemaVersion: settled.Version, EventID: uuid.New(), TransferID: uuid.New(),
		FromAccount: "acct-001", ToAccount: "acct-002", AmountCents: 12_345, Currency: "BRL", SettledAt: time.Now().UTC()})
	if err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if _, err := settled.Decode(p); err != nil {
			b.Fatal(err)
		}
	}
}
