package fraud

import (
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/tedbank/outbox/consumer"
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
// be processed and is dead-lettered after MaxDeliveries (consumer.ErrInvalid).
var ErrInvalidEvent = consumer.ErrInvalid

// DecodeEntry decodes the fields of a stream entry written by the relay.
func DecodeEntry(values map[string]any) (Event, error) {
	m, err := consumer.DecodeEntry("", values)
	if err != nil {
		return Event{}, err
	}
	return decodeMessage(m)
}

// decodeMessage decodes a transfer.settled message.
func decodeMessage(m consumer.Message) (Event, error) {
	if m.Type != settled.Type {
		return Event{}, consumer.Invalid("unknown event type %q", m.Type)
	}
	ev, err := DecodeSettled(m.Payload)
	if err != nil {
		return Event{}, err
	}
	if ev.EventID != m.ID {
		return Event{}, consumer.Invalid("payload event_id %s differs from entry event_id %s", ev.EventID, m.ID)
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
