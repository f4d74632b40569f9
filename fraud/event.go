package fraud

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/tedbank/outbox/transfer"
)

// Event is a decoded, validated transfer.settled stream entry.
type Event struct {
	EventID     uuid.UUID
	TransferID  uuid.UUID
	FromAccount string
	ToAccount   string
	AmountCents int64
	Currency    string
	SettledAt   time.Time
}

// ErrInvalidEvent is wrapped by every decoding error: such an entry can never
// be processed and is dead-lettered after MaxDeliveries.
var ErrInvalidEvent = errors.New("invalid event")

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalidEvent, fmt.Sprintf(format, args...))
}

// DecodeEntry decodes the fields of a stream entry written by the relay.
func DecodeEntry(values map[string]any) (Event, error) {
	if values == nil {
		return Event{}, invalid("entry has no fields (deleted or trimmed)")
	}
	str := func(k string) (string, error) {
		v, ok := values[k]
		if !ok {
			return "", invalid("missing field %q", k)
		}
		s, ok := v.(string)
		if !ok {
			return "", invalid("field %q is not a string", k)
		}
		return s, nil
	}
	eventType, err := str("event_type")
	if err != nil {
		return Event{}, err
	}
	if eventType != transfer.EventSettled {
		return Event{}, invalid("unknown event type %q", eventType)
	}
	rawID, err := str("event_id")
	if err != nil {
		return Event{}, err
	}
	eventID, err := uuid.Parse(rawID)
	if err != nil {
		return Event{}, invalid("event_id %q is not a UUID", rawID)
	}
	payload, err := str("payload")
	if err != nil {
		return Event{}, err
	}
	ev, err := DecodeSettled([]byte(payload))
	if err != nil {
		return Event{}, err
	}
	if ev.EventID != eventID {
		return Event{}, invalid("payload event_id %s differs from entry event_id %s", ev.EventID, eventID)
	}
	return ev, nil
}

// DecodeSettled decodes and validates a transfer.settled payload.
func DecodeSettled(payload []byte) (Event, error) {
	var p struct {
		SchemaVersion *int       `json:"schema_version"`
		EventID       *uuid.UUID `json:"event_id"`
		TransferID    *uuid.UUID `json:"transfer_id"`
		FromAccount   *string    `json:"from_account"`
		ToAccount     *string    `json:"to_account"`
		AmountCents   *int64     `json:"amount_cents"`
		Currency      *string    `json:"currency"`
		SettledAt     *time.Time `json:"settled_at"`
	}
	dec := json.NewDecoder(bytes.NewReader(payload))
	if err := dec.Decode(&p); err != nil {
		return Event{}, invalid("payload: %v", err)
	}
	if dec.More() {
		return Event{}, invalid("payload: trailing data")
	}
	switch {
	case p.SchemaVersion == nil || *p.SchemaVersion != transfer.SchemaVersion:
		return Event{}, invalid("payload: schema_version must be %d", transfer.SchemaVersion)
	case p.EventID == nil || *p.EventID == uuid.Nil:
		return Event{}, invalid("payload: missing event_id")
	case p.TransferID == nil || *p.TransferID == uuid.Nil:
		return Event{}, invalid("payload: missing transfer_id")
	case p.FromAccount == nil || *p.FromAccount == "" || len(*p.FromAccount) > transfer.MaxAccountLen:
		return Event{}, invalid("payload: from_account must have 1 to %d bytes", transfer.MaxAccountLen)
	case p.ToAccount == nil || *p.ToAccount == "" || len(*p.ToAccount) > transfer.MaxAccountLen:
		return Event{}, invalid("payload: to_account must have 1 to %d bytes", transfer.MaxAccountLen)
	case p.AmountCents == nil || *p.AmountCents <= 0 || *p.AmountCents > maxAmountCents:
		return Event{}, invalid("payload: amount_cents must be between 1 and %d", int64(maxAmountCents))
	case p.Currency == nil || !transfer.Currencies[*p.Currency]:
		return Event{}, invalid("payload: unsupported currency")
	case p.SettledAt == nil || p.SettledAt.IsZero():
		return Event{}, invalid("payload: missing settled_at")
	}
	return Event{
		EventID: *p.EventID, TransferID: *p.TransferID,
		FromAccount: *p.FromAccount, ToAccount: *p.ToAccount,
		AmountCents: *p.AmountCents, Currency: *p.Currency, SettledAt: *p.SettledAt,
	}, nil
}

// maxAmountCents keeps sums exact in the effect script, whose numbers are
// doubles (exact up to 2^53).
const maxAmountCents = 1 << 50
