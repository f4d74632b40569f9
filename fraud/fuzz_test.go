package fraud

import (
	"errors"
	"testing"
)

// FuzzDecodeSettled: any payload either decodes into a valid event or is
// rejected as ErrInvalidEvent; it never panics or returns another error.
func FuzzDecodeSettled(f *testing.F) {
	f.Add([]byte(`{"schema_version":1,"event_id":"0192a0b0-0000-7000-8000-000000000001","transfer_id":"0192a0b0-0000-7000-8000-000000000002","from_account":"a","to_account":"b","amount_cents":100,"currency":"BRL","settled_at":"2026-01-02T03:04:05Z"}`))
	f.Add([]byte(`{}`))
	f.Add([]byte(`[]`))
	f.Add([]byte(`null`))
	f.Add([]byte(`{"amount_cents":"ten"}`))
	f.Add([]byte(`{"schema_version":1,"amount_cents":-1}`))
	f.Add([]byte("\xff\xfe"))
	f.Fuzz(func(t *testing.T, payload []byte) {
		ev, err := DecodeSettled(payload)
		if err != nil {
			if !errors.Is(err, ErrInvalidEvent) {
				t.Fatalf("error %v is not ErrInvalidEvent", err)
			}
			return
		}
		if ev.AmountCents <= 0 || ev.FromAccount == "" || ev.ToAccount == "" || ev.SettledAt.IsZero() {
			t.Fatalf("accepted an invalid event %+v from %q", ev, payload)
		}
	})
}

// FuzzDecodeEntry: stream entries with arbitrary fields never panic and are
// either valid or ErrInvalidEvent.
func FuzzDecodeEntry(f *testing.F) {
	f.Add("transfer.settled", "0192a0b0-0000-7000-8000-000000000001", `{"schema_version":1}`)
	f.Add("", "", "")
	f.Add("transfer.reversed", "x", "{")
	f.Fuzz(func(t *testing.T, eventType, eventID, payload string) {
		_, err := DecodeEntry(map[string]any{"event_type": eventType, "event_id": eventID, "payload": payload})
		if err != nil && !errors.Is(err, ErrInvalidEvent) {
			t.Fatalf("error %v is not ErrInvalidEvent", err)
		}
	})
}
