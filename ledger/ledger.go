// Package ledger is an example of a consumer that keeps its state in its own
// PostgreSQL (package consumer/inbox): each transfer.settled event posts a
// double entry, a debit on the sender's account and a credit on the
// receiver's, in the transaction that records the event id in the inbox. A
// consumer that crashes at any point posts each TED once: the balances equal
// the sums of the transfers (Check; `outbox reconcile --ledger-database-url`).
//
// Adding a consumer of your own follows the same three steps: a Handler
// (HandleTx: decode, then write through the transaction), your schema
// beside the inbox's (Migrate), and New (an inbox and a consumer group).
package ledger

import (
	"cmp"
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/consumer/inbox"
	"github.com/tedbank/outbox/consumer/source"
	"github.com/tedbank/outbox/internal/migrate"
	"github.com/tedbank/outbox/internal/queries"
	"github.com/tedbank/outbox/transfer/settled"
)

// Defaults of Config.
const (
	DefaultStream = "outbox.event.transfer"
	DefaultGroup  = "ledger"
)

// Handler posts a transfer.settled event's double entry.
type Handler struct{}

// HandleTx posts m's double entry through tx. An event that is not a valid
// transfer.settled can never be posted: its error wraps consumer.ErrInvalid.
func (h Handler) HandleTx(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
	return h.HandleBatchTx(ctx, tx, []consumer.Message{m})
}

// HandleBatchTx posts the double entries of msgs through tx in one
// statement (inbox.BatchHandler), in order. One invalid event fails them
// all (the inbox then posts them one by one, and that one is
// dead-lettered).
func (Handler) HandleBatchTx(ctx context.Context, tx pgx.Tx, msgs []consumer.Message) error {
	n := len(msgs)
	var (
		transfers, events = make([]uuid.UUID, n), make([]uuid.UUID, n)
		from, to          = make([]string, n), make([]string, n)
		amounts           = make([]int64, n)
		currencies        = make([]string, n)
		settledAt         = make([]time.Time, n)
	)
	for i, m := range msgs {
		p, err := decode(m)
		if err != nil {
			return fmt.Errorf("event %s: %w", m.ID, err)
		}
		transfers[i], events[i], from[i], to[i] = p.TransferID, p.EventID, p.FromAccount, p.ToAccount
		amounts[i], currencies[i], settledAt[i] = p.AmountCents, p.Currency, p.SettledAt
	}
	st := queries.LedgerPost(transfers, events, from, to, amounts, currencies, settledAt)
	if _, err := tx.Exec(ctx, st.SQL, st.Args...); err != nil {
		return fmt.Errorf("post %d transfers (the first %s): %w", n, transfers[0], err)
	}
	return nil
}

// decode reads m's transfer.settled payload; an error wraps
// consumer.ErrInvalid.
func decode(m consumer.Message) (settled.Payload, error) {
	if m.Type != settled.Type {
		return settled.Payload{}, consumer.Invalid("event type %q: the ledger posts %s events only", m.Type, settled.Type)
	}
	p, err := settled.Decode(m.Payload)
	if err != nil {
		return settled.Payload{}, fmt.Errorf("%w: %w", consumer.ErrInvalid, err)
	}
	if p.EventID != m.ID {
		return settled.Payload{}, consumer.Invalid("payload event_id %s differs from the entry's %s", p.EventID, m.ID)
	}
	return p, nil
}

// Migrate creates or updates the ledger's tables and the inbox's in db, the
// ledger's own database. Safe when several processes start at once.
func Migrate(ctx context.Context, db *pgxpool.Pool) error {
	if _, err := inbox.Migrate(ctx, db); err != nil {
		return err
	}
	if _, err := migrate.UpLedger(ctx, db); err != nil {
		return err
	}
	return nil
}

// Config says where the ledger reads and how. Consumer is the consumer
// group's configuration: its Name is "ledger", and its Stream and Group
// default to DefaultStream and DefaultGroup.
type Config struct {
	Consumer consumer.Config
	Inbox    inbox.Config
}

// New returns a ledger consumer: it reads with rdb and posts to db.
func New(db *pgxpool.Pool, rdb redis.Cmdable, cfg Config) (*consumer.Consumer, error) {
	in, cc, err := cfg.parts(db)
	if err != nil {
		return nil, err
	}
	return consumer.New(rdb, in, cc)
}

// NewWithSource returns a ledger consumer that reads from src (NATS
// JetStream: natssource.New), keeps its leases in rdb and posts to db.
func NewWithSource(db *pgxpool.Pool, rdb redis.Cmdable, src source.Source, cfg Config) (*consumer.Consumer, error) {
	in, cc, err := cfg.parts(db)
	if err != nil {
		return nil, err
	}
	return consumer.NewWithSource(rdb, src, in, cc)
}

// parts are the inbox and the consumer group's configuration of cfg.
func (cfg Config) parts(db *pgxpool.Pool) (*inbox.Inbox, consumer.Config, error) {
	in, err := inbox.New(db, Handler{}, cfg.Inbox)
	if err != nil {
		return nil, consumer.Config{}, err
	}
	cc := cfg.Consumer
	cc.Name = "ledger"
	cc.Stream = cmp.Or(cc.Stream, DefaultStream)
	cc.Group = cmp.Or(cc.Group, DefaultGroup)
	return in, cc, nil
}

// Balance is one account's balance.
type Balance struct {
	Account      string `json:"account"`
	BalanceCents int64  `json:"balance_cents"`
	Entries      int64  `json:"entries"`
}

// Balances reads every account's balance, by account.
func Balances(ctx context.Context, db *pgxpool.Pool) ([]Balance, error) {
	st := queries.LedgerBalances()
	rows, err := db.Query(ctx, st.SQL, st.Args...)
	if err != nil {
		return nil, fmt.Errorf("read balances: %w", err)
	}
	bs, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Balance])
	if err != nil {
		return nil, fmt.Errorf("read balances: %w", err)
	}
	return bs, nil
}
