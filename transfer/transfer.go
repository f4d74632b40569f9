// Package transfer settles TEDs (Brazilian wire transfers) and records the
// transfer.settled event in the transactional outbox in the same transaction:
// both rows are committed, or neither is.
package transfer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/tedbank/outbox"
	"github.com/tedbank/outbox/internal/queries"
	"github.com/tedbank/outbox/internal/tracing"
	"github.com/tedbank/outbox/transfer/settled"
)

const (
	// AggregateType is the outbox aggregate type of transfer events; they are
	// published to the stream outbox.event.transfer by default.
	AggregateType = settled.AggregateType
	// EventSettled is the event type written for every settled transfer.
	EventSettled = settled.Type
	// SchemaVersion is the version of the SettledEvent payload.
	SchemaVersion = settled.Version
	// DefaultCurrency is used when a Transfer has none.
	DefaultCurrency = "BRL"
	// MaxAccountLen is the longest account identifier accepted.
	MaxAccountLen = settled.MaxAccountLen
)

// Transfer is a TED to settle.
type Transfer struct {
	ID          uuid.UUID // chosen by the caller; settling the same id twice is a no-op
	FromAccount string
	ToAccount   string
	AmountCents int64
	Currency    string // ISO 4217; empty means BRL
}

// SettledEvent is the payload of transfer.settled: the event contract,
// package settled, which consumers import without this package.
type SettledEvent = settled.Payload

// Result says what Settle did.
type Result struct {
	TransferID uuid.UUID
	// EventID is the id of the transfer.settled event written; zero when
	// AlreadySettled.
	EventID uuid.UUID
	// AlreadySettled is true when the transfer id had been settled before with
	// the same details: nothing was written.
	AlreadySettled bool
	SettledAt      time.Time
}

// ErrInvalid is wrapped by every *ValidationError.
var ErrInvalid = errors.New("invalid transfer")

// ErrConflict is returned when a transfer id was already settled with other
// details (a caller bug: ids must not be reused).
var ErrConflict = errors.New("transfer id already settled with different details")

// ValidationError says which field of a Transfer is wrong. Nothing is written.
type ValidationError struct {
	Field  string
	Reason string
}

func (e *ValidationError) Error() string {
	return fmt.Sprintf("invalid transfer: %s %s", e.Field, e.Reason)
}

// Unwrap makes errors.Is(err, ErrInvalid) true.
func (e *ValidationError) Unwrap() error { return ErrInvalid }

// Validate returns a *ValidationError for the first bad field of t (after
// defaulting the currency), or nil.
func (t Transfer) Validate() error {
	bad := func(field, reason string) error { return &ValidationError{Field: field, Reason: reason} }
	from, to := strings.TrimSpace(t.FromAccount), strings.TrimSpace(t.ToAccount)
	switch {
	case t.ID == uuid.Nil:
		return bad("id", "is required")
	case from == "":
		return bad("from_account", "is required")
	case to == "":
		return bad("to_account", "is required")
	case len(from) > MaxAccountLen || from != t.FromAccount:
		return bad("from_account", fmt.Sprintf("must have 1 to %d characters and no surrounding spaces", MaxAccountLen))
	case len(to) > MaxAccountLen || to != t.ToAccount:
		return bad("to_account", fmt.Sprintf("must have 1 to %d characters and no surrounding spaces", MaxAccountLen))
	case from == to:
		return bad("to_account", "must differ from from_account")
	case t.AmountCents <= 0:
		return bad("amount_cents", "must be positive")
	case t.AmountCents > settled.MaxAmountCents:
		return bad("amount_cents", fmt.Sprintf("must be at most %d (the event contract's maximum)", int64(settled.MaxAmountCents)))
	case !settled.IsCurrency(t.currency()):
		return bad("currency", fmt.Sprintf("%q is not a supported ISO 4217 code", t.Currency))
	}
	return nil
}

func (t Transfer) currency() string {
	if t.Currency == "" {
		return DefaultCurrency
	}
	return t.Currency
}

// TxBeginner starts transactions: *pgxpool.Pool, *pgx.Conn and pgx.Tx are one.
type TxBeginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Settle settles t in its own transaction: the transfer row and its
// transfer.settled outbox event are committed together, or not at all.
func Settle(ctx context.Context, db TxBeginner, t Transfer) (Result, error) {
	var res Result
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var err error
		res, err = SettleTx(ctx, tx, t)
		return err
	})
	if err != nil {
		return Result{}, err
	}
	return res, nil
}

// SettleTx settles t inside the caller's transaction, for services that change
// more in the same unit of work. Nothing is visible until the caller commits;
// if the caller rolls back, neither the transfer nor its event exists.
func SettleTx(ctx context.Context, tx pgx.Tx, t Transfer) (res Result, err error) {
	ctx, span := tracer.Start(ctx, "transfer.settle", trace.WithAttributes(
		attribute.String("transfer.id", t.ID.String()), attribute.Int64("transfer.amount_cents", t.AmountCents)))
	defer func() {
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}()
	return settleTx(ctx, tx, t)
}

var tracer = tracing.Tracer("github.com/tedbank/outbox/transfer")

func settleTx(ctx context.Context, tx pgx.Tx, t Transfer) (Result, error) {
	if err := t.Validate(); err != nil {
		return Result{}, err
	}
	t.Currency = t.currency()
	res := Result{TransferID: t.ID}

	q := queries.TransferInsert(t.ID, t.FromAccount, t.ToAccount, t.AmountCents, t.Currency)
	err := tx.QueryRow(ctx, q.SQL, q.Args...).Scan(&res.SettledAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return alreadySettled(ctx, tx, t)
	}
	if err != nil {
		return Result{}, fmt.Errorf("insert transfer %s: %w", t.ID, err)
	}

	eventID, err := uuid.NewV7()
	if err != nil {
		return Result{}, fmt.Errorf("new event id: %w", err)
	}
	payload, err := json.Marshal(SettledEvent{
		SchemaVersion: SchemaVersion,
		EventID:       eventID,
		TransferID:    t.ID,
		FromAccount:   t.FromAccount,
		ToAccount:     t.ToAccount,
		AmountCents:   t.AmountCents,
		Currency:      t.Currency,
		SettledAt:     res.SettledAt.UTC(),
	})
	if err != nil {
		return Result{}, fmt.Errorf("encode %s payload: %w", EventSettled, err)
	}
	if _, err := outbox.Write(ctx, tx, outbox.Message{
		ID:            eventID,
		AggregateType: AggregateType,
		AggregateID:   t.ID.String(),
		EventType:     EventSettled,
		// One sender's TEDs in settled order: the velocity rule sums a
		// sender's recent transfers.
		PartitionKey: t.FromAccount,
		Payload:      payload,
		Headers:      map[string]string{"schema_version": fmt.Sprint(SchemaVersion)},
	}); err != nil {
		return Result{}, fmt.Errorf("write %s event for transfer %s: %w", EventSettled, t.ID, err)
	}
	res.EventID = eventID
	return res, nil
}

// alreadySettled handles a transfer id that exists: the same details are an
// idempotent retry, other details are a conflict.
func alreadySettled(ctx context.Context, tx pgx.Tx, t Transfer) (Result, error) {
	var prev Transfer
	var settledAt time.Time
	q := queries.TransferGet(t.ID)
	err := tx.QueryRow(ctx, q.SQL, q.Args...).
		Scan(&prev.FromAccount, &prev.ToAccount, &prev.AmountCents, &prev.Currency, &settledAt)
	if err != nil {
		return Result{}, fmt.Errorf("read settled transfer %s: %w", t.ID, err)
	}
	prev.ID = t.ID
	if prev != t {
		return Result{}, fmt.Errorf("%w: %s", ErrConflict, t.ID)
	}
	return Result{TransferID: t.ID, AlreadySettled: true, SettledAt: settledAt}, nil
}

// FormatBRL formats cents as reais the Brazilian way: 1234567 -> "12.345,67".
func FormatBRL(cents int64) string {
	sign := ""
	if cents < 0 {
		sign, cents = "-", -cents
	}
	whole := fmt.Sprint(cents / 100)
	var b strings.Builder
	for i, ch := range whole {
		if i > 0 && (len(whole)-i)%3 == 0 {
			b.WriteByte('.')
		}
		b.WriteRune(ch)
	}
	return fmt.Sprintf("%s%s,%02d", sign, b.String(), cents%100)
}
