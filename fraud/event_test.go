package fraud

import (
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/tedbank/outbox/consumer"
)

func testEntry(mutate func(p map[string]any, v map[string]any)) map[string]any {
	id := uuid.NewString()
	p := map[string]any{
		"schema_version": 1, "event_id": id, "transfer_id": uuid.NewString(),
		"from_account": "a", "to_account": "b", "amount_cents": 100, "currency": "BRL",
		"settled_at": time.Now().UTC().Format(time.RFC3339Nano),
	}
	v := map[string]any{"event_id": id, "event_type": "transfer.settled", "aggregate_type": "transfer"}
	if mutate != nil {
		mutate(p, v)
	}
	if _, ok := v["payload"]; !ok {
		b, _ := json.Marshal(p)
		v["payload"] = string(b)
	}
	return v
}

func TestDecodeEntry(t *testing.T) {
	ev, err := DecodeEntry(testEntry(nil))
	if err != nil {
		t.Fatal(err)
	}
	if ev.AmountCents != 100 || ev.FromAccount != "a" || ev.Currency != "BRL" || ev.SettledAt.IsZero() {
		t.Fatalf("decoded %+v", ev)
	}
	bad := map[string]func(p, v map[string]any){
		"no fields":         nil,
		"missing event_id":  func(p, v map[string]any) { delete(v, "event_id") },
		"bad event_id":      func(p, v map[string]any) { v["event_id"] = "x" },
		"ids differ":        func(p, v map[string]any) { v["event_id"] = uuid.NewString() },
		"unknown type":      func(p, v map[string]any) { v["event_type"] = "transfer.reversed" },
		"payload not json":  func(p, v map[string]any) { v["payload"] = "{" },
		"payload array":     func(p, v map[string]any) { v["payload"] = "[]" },
		"amount string":     func(p, v map[string]any) { p["amount_cents"] = "100" },
		"amount zero":       func(p, v map[string]any) { p["amount_cents"] = 0 },
		"amount huge":       func(p, v map[string]any) { p["amount_cents"] = 1 << 60 },
		"missing from":      func(p, v map[string]any) { delete(p, "from_account") },
		"bad currency":      func(p, v map[string]any) { p["currency"] = "XXX" },
		"no settled_at":     func(p, v map[string]any) { delete(p, "settled_at") },
		"schema v2":         func(p, v map[string]any) { p["schema_version"] = 2 },
		"trailing garbage":  func(p, v map[string]any) { b, _ := json.Marshal(p); v["payload"] = string(b) + "x" },
		"payload not field": func(p, v map[string]any) { v["payload"] = 42 },
	}
	for name, mutate := range bad {
		var values map[string]any
		if mutate != nil {
			values = testEntry(mutate)
		}
		if _, err := DecodeEntry(values); !errors.Is(err, ErrInvalidEvent) {
			t.Errorf("%s: err = %v, want ErrInvalidEvent", name, err)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	if err := (Config{}).Validate(); err != nil {
		t.Fatalf("zero config: %v", err)
	}
	for name, c := range map[string]Config{
		"bad stream":      {Config: consumer.Config{Stream: "a b"}},
		"negative batch":  {Config: consumer.Config{BatchSize: -1}},
		"negative block":  {Config: consumer.Config{Block: -time.Second}},
		"zero deliveries": {Config: consumer.Config{MaxDeliveries: -1}},
		"ttl below idle":  {DedupeTTL: 2 * time.Minute, Config: consumer.Config{ClaimMinIdle: time.Hour}},
		"bad prefix":      {Config: consumer.Config{KeyPrefix: "x y"}},
	} {
		if err := c.Validate(); !errors.Is(err, ErrConfig) {
			t.Errorf("%s: Validate = %v, want an ErrConfig", name, err)
		}
	}
}
