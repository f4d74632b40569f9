package fraud

import (
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/tedbank/outbox/relay/entry"
	"github.com/tedbank/outbox/transfer/settled"
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
	eventType, err := str(entry.EventType)
	if err != nil {
		return Event{}, err
	}
	if eventType != settled.Type {
		return Event{}, invalid("unknown event type %q", eventType)
	}
	rawID, err := str(entry.EventID)
	if err != nil {
		return Event{}, err
	}
	eventID, err := uuid.Parse(rawID)
	if err != nil {
		return Event{}, invalid("event_id %q is not a UUID", rawID)
	}
	payload, err := str(entry.Payload)
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

// DecodeSettled decodes and validates a transfer.settled payload
// (settled.Decode); its errors wrap ErrInvalidEvent.
func DecodeSettled(payload []byte) (Event, error) {
	p, err := settled.Decode(payload)
	if err != nil {
		return Event{}, fmt.Errorf("%w: %w", ErrInvalidEvent, err)
	}
	return Event{
		EventID: p.EventID, TransferID: p.TransferID,
		FromAccount: p.FromAccount, ToAccount: p.ToAccount,
		AmountCents: p.AmountCents, Currency: p.Currency, SettledAt: p.SettledAt,
	}, nil
}
