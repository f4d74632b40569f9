// Package settled is the contract of the transfer.settled event: its type
// name, schema version, payload and the rules every payload obeys. The
// writer (package transfer) encodes it and consumers (package fraud, or a
// service in another repository) decode it with Decode. It imports nothing
// of this project, so a consumer that links it links no PostgreSQL driver and
// no outbox writer.
package settled

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/google/uuid"
)

const (
	// Type is the event type of a settled transfer.
	Type = "transfer.settled"
	// AggregateType is the outbox aggregate type of transfer events; the
	// relay publishes them to the stream outbox.event.transfer by default.
	AggregateType = "transfer"
	// Version is the payload's schema version (Payload.SchemaVersion).
	Version = 1
	// MaxAccountLen is the longest account identifier, in bytes.
	MaxAccountLen = 64
	// MaxAmountCents is the largest amount: sums of amounts stay exact in
	// double precision (2^53), which the anti-fraud effect script uses.
	MaxAmountCents = 1 << 50
)

// currencies are the ISO 4217 codes a transfer may have.
var currencies = []string{
	"ARS", "AUD", "BRL", "CAD", "CHF", "CLP", "CNY", "COP",
	"EUR", "GBP", "JPY", "MXN", "PEN", "PYG", "USD", "UYU",
}

// Currencies returns the ISO 4217 codes a transfer may have, sorted.
func Currencies() []string { return slices.Clone(currencies) }

// IsCurrency reports whether code is one of Currencies.
func IsCurrency(code string) bool {
	_, found := slices.BinarySearch(currencies, code)
	return found
}

// Payload is the event's JSON payload. It carries everything the anti-fraud
// service needs, so consumers never call back.
type Payload struct {
	SchemaVersion int       `json:"schema_version"`
	EventID       uuid.UUID `json:"event_id"`
	TransferID    uuid.UUID `json:"transfer_id"`
	FromAccount   string    `json:"from_account"`
	ToAccount     string    `json:"to_account"`
	AmountCents   int64     `json:"amount_cents"`
	Currency      string    `json:"currency"`
	SettledAt     time.Time `json:"settled_at"`
}

// ErrInvalid is wrapped by every error of Decode: such a payload can never
// be processed.
var ErrInvalid = errors.New("invalid transfer.settled payload")

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalid, fmt.Sprintf(format, args...))
}

// Decode decodes one JSON payload and checks every field: all present, the
// schema version this package knows, non-nil ids, accounts of 1 to
// MaxAccountLen bytes, an amount from 1 to MaxAmountCents, a known currency
// and a settlement time.
func Decode(payload []byte) (Payload, error) {
	// Every field's zero value is invalid, so a field left out (or null)
	// fails its check like a wrong one; json.Unmarshal refuses trailing
	// data. (A json.Decoder and a pointer per field cost twice the time.)
	var p Payload
	if err := json.Unmarshal(payload, &p); err != nil {
		return Payload{}, invalid("%v", err)
	}
	switch {
	case p.SchemaVersion != Version:
		return Payload{}, invalid("schema_version must be %d", Version)
	case p.EventID == uuid.Nil:
		return Payload{}, invalid("missing event_id")
	case p.TransferID == uuid.Nil:
		return Payload{}, invalid("missing transfer_id")
	case p.FromAccount == "" || len(p.FromAccount) > MaxAccountLen:
		return Payload{}, invalid("from_account must have 1 to %d bytes", MaxAccountLen)
	case p.ToAccount == "" || len(p.ToAccount) > MaxAccountLen:
		return Payload{}, invalid("to_account must have 1 to %d bytes", MaxAccountLen)
	case p.AmountCents <= 0 || p.AmountCents > MaxAmountCents:
		return Payload{}, invalid("amount_cents must be between 1 and %d", int64(MaxAmountCents))
	case !IsCurrency(p.Currency):
		return Payload{}, invalid("unsupported currency")
	case p.SettledAt.IsZero():
		return Payload{}, invalid("missing settled_at")
	}
	return p, nil
}
