// Package inbox makes a consumer's effects exactly-once in its own
// PostgreSQL: the inbox pattern. Each message's effect runs in a transaction
// together with an insert of its event id into consumer_inbox; a redelivered
// message finds its id there and is skipped (and acknowledged). A crash
// before the commit leaves neither the effect nor the id (the message is
// delivered again and applied); a crash after it leaves both (the
// redelivery is a duplicate).
//
// An Inbox is a consumer.Handler: give it a Handler of your own and pass it
// to consumer.New.
//
//	in, err := inbox.New(db, inbox.HandlerFunc(func(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
//		_, err := tx.Exec(ctx, "UPDATE balances SET ...", ...)
//		return err
//	}), inbox.Config{})
//	c, err := consumer.New(rdb, in, consumer.Config{Name: "ledger", Stream: "outbox.event.transfer"})
//	err = c.Run(ctx)
//
// A batch of messages is applied in one transaction (one commit for the
// batch); if a handler fails, the batch is rolled back and its messages are
// applied one transaction each, so that one failing message does not hold
// the other keys back, while the later messages of its own key are held
// (consumer.Held) until it is applied: a key's order survives the failure. With partition ownership each transaction also checks the
// partition's fence (consumer_fences): a consumer that lost the partition
// commits nothing.
//
// The inbox keeps each event id for Config.Retention, then deletes it in
// small batches (Maintain, run by the consumer). Migrate creates the tables.
package inbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/internal/failpoint"
	"github.com/tedbank/outbox/internal/migrate"
	"github.com/tedbank/outbox/internal/queries"
)

// Handler applies one message's effect in tx, the transaction that records
// the message in the inbox. It must do all of its writes through tx (a
// write elsewhere is not undone with the transaction, nor skipped on a
// redelivery) and return an error to roll it back: an error wrapping
// consumer.ErrInvalid for a message that can never be applied (it is
// dead-lettered), any other for a transient failure (retried).
type Handler interface {
	HandleTx(ctx context.Context, tx pgx.Tx, m consumer.Message) error
}

// BatchHandler is a Handler that can apply several messages at once: the
// inbox calls HandleBatchTx with the messages of a batch that are new (not
// yet in the inbox), in order, instead of HandleTx for each, so that their
// writes can share round trips (the ledger posts a batch in one INSERT). An
// error rolls the whole transaction back; the inbox then applies the
// batch's messages one by one (HandleTx), so that one invalid or failing
// message does not hold back the others' keys.
type BatchHandler interface {
	Handler
	HandleBatchTx(ctx context.Context, tx pgx.Tx, msgs []consumer.Message) error
}

// HandlerFunc is a Handler made of a function.
type HandlerFunc func(ctx context.Context, tx pgx.Tx, m consumer.Message) error

// HandleTx calls f.
func (f HandlerFunc) HandleTx(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
	return f(ctx, tx, m)
}

// Defaults of Config.
const (
	DefaultRetention       = 7 * 24 * time.Hour
	DefaultCleanupInterval = time.Minute
	DefaultCleanupBatch    = 1000
)

// Config tunes an Inbox. The zero value of every field means its default.
type Config struct {
	// Retention is how long an event id stays in the inbox. It must outlive
	// every redelivery: consumer.New rejects one that does not
	// (consumer.Config.CheckDedupeWindow). Default 7 days.
	Retention time.Duration
	// CleanupInterval is how often the ids past the retention are deleted,
	// CleanupBatch at a time (each batch its own short transaction).
	CleanupInterval time.Duration
	CleanupBatch    int
	// Logger receives the inbox's logs. Default: slog.Default().
	Logger *slog.Logger
}

// ErrConfig is wrapped by the error of New for a Config that cannot work.
var ErrConfig = errors.New("inbox config")

// Inbox is a consumer.Handler that applies each message with a Handler in a
// transaction on db, with the message's event id recorded in the inbox.
type Inbox struct {
	db    *pgxpool.Pool
	h     Handler
	cfg   Config
	group atomic.Value // the consumer group (a string), learnt from the batches: Maintain cleans its rows
}

// New returns an inbox applying with h on db. It checks cfg but does not
// connect.
func New(db *pgxpool.Pool, h Handler, cfg Config) (*Inbox, error) {
	cfg.Retention = cmp.Or(cfg.Retention, DefaultRetention)
	cfg.CleanupInterval = cmp.Or(cfg.CleanupInterval, DefaultCleanupInterval)
	cfg.CleanupBatch = cmp.Or(cfg.CleanupBatch, DefaultCleanupBatch)
	cfg.Logger = cmp.Or(cfg.Logger, slog.Default())
	switch {
	case db == nil || h == nil:
		return nil, fmt.Errorf("%w: a database and a handler are needed", ErrConfig)
	case cfg.Retention < time.Minute:
		return nil, fmt.Errorf("%w: retention %s: must be at least a minute", ErrConfig, cfg.Retention)
	case cfg.CleanupInterval <= 0 || cfg.CleanupBatch < 1:
		return nil, fmt.Errorf("%w: cleanup every %s, %d at a time: both must be positive", ErrConfig, cfg.CleanupInterval, cfg.CleanupBatch)
	}
	return &Inbox{db: db, h: h, cfg: cfg}, nil
}

// Migrate creates or updates the inbox's tables (sql/inbox) in db, the
// consumer's own database, and returns the names of the migrations it
// applied. Safe when several processes start at once.
func Migrate(ctx context.Context, db *pgxpool.Pool) ([]string, error) {
	res, err := migrate.UpInbox(ctx, db)
	names := make([]string, len(res.Applied))
	for i, m := range res.Applied {
		names[i] = fmt.Sprintf("%04d_%s", m.Version, m.Name)
	}
	return names, err
}

// Ready reports why the inbox cannot apply effects right now (its database
// does not answer), or nil; the consumer's Ready asks it.
func (in *Inbox) Ready(ctx context.Context) error {
	if err := in.db.Ping(ctx); err != nil {
		return fmt.Errorf("inbox database: %w", err)
	}
	return nil
}

// DedupeTTL is the inbox's retention (consumer.Deduper).
func (in *Inbox) DedupeTTL() time.Duration { return in.cfg.Retention }

// Handle applies b's messages: all in one transaction, or, if a handler
// fails, each in its own.
func (in *Inbox) Handle(ctx context.Context, b consumer.Batch) []consumer.Result {
	if in.group.Load() == nil {
		in.group.Store(b.Group)
	}
	epoch, err := fenceEpoch(b.Fence)
	res := make([]consumer.Result, len(b.Messages))
	if err != nil {
		for i := range res {
			res[i].Err = err
		}
		return res
	}
	if err := in.apply(ctx, b, epoch, b.Messages, res); err == nil || len(b.Messages) == 1 || errors.Is(err, consumer.ErrFenced) {
		if err != nil {
			for i := range res {
				res[i] = consumer.Result{Err: err}
			}
		}
		return res
	}
	// One message (or the commit) failed: apply each on its own, so that
	// the other keys are not held back by it; the later messages of a key
	// whose message failed are held (consumer.Order): they must not take
	// effect before it.
	var order consumer.Order
	for i, m := range b.Messages {
		if order.Holds(m) {
			res[i] = consumer.Held(m)
			continue
		}
		if err := in.apply(ctx, b, epoch, b.Messages[i:i+1], res[i:i+1]); err != nil {
			res[i] = consumer.Result{Err: err}
			order.Failed(m, err)
		}
	}
	return res
}

// apply runs msgs in one transaction and fills res (one per message) if it
// commits; the error says why it did not.
func (in *Inbox) apply(ctx context.Context, b consumer.Batch, epoch int64, msgs []consumer.Message, res []consumer.Result) error {
	tx, err := in.db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("inbox: begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // after a commit, a no-op
	ids := make([]uuid.UUID, len(msgs))
	for i, m := range msgs {
		ids[i] = m.ID
	}
	var batch pgx.Batch
	var fenced bool
	if b.Fence != "" {
		st := queries.InboxFence(b.Group, b.Partition, epoch)
		batch.Queue(st.SQL, st.Args...).QueryRow(func(row pgx.Row) error {
			var stored int64
			if err := row.Scan(&stored); errors.Is(err, pgx.ErrNoRows) {
				fenced = true
			} else if err != nil {
				return err
			}
			return nil
		})
	}
	fresh := map[uuid.UUID]bool{}
	st := queries.InboxInsert(b.Group, ids)
	batch.Queue(st.SQL, st.Args...).Query(func(rows pgx.Rows) error {
		var id uuid.UUID
		_, err := pgx.ForEachRow(rows, []any{&id}, func() error {
			fresh[id] = true
			return nil
		})
		return err
	})
	if err := tx.SendBatch(ctx, &batch).Close(); err != nil {
		return fmt.Errorf("inbox: record %d event ids: %w", len(ids), err)
	}
	if fenced {
		return fmt.Errorf("%w: partition %d of group %s has an owner newer than lease epoch %d (consumer_fences)",
			consumer.ErrFenced, b.Partition, b.Group, epoch)
	}
	failpoint.Inject("inbox.after-insert")
	var apply []consumer.Message
	for i, m := range msgs {
		if !fresh[m.ID] {
			res[i].Outcome = consumer.Duplicate
			continue
		}
		delete(fresh, m.ID) // the same event twice in one batch: the second is a duplicate
		apply = append(apply, m)
		res[i].Outcome = consumer.Applied
	}
	if bh, ok := in.h.(BatchHandler); ok && len(apply) > 1 {
		if err := bh.HandleBatchTx(ctx, tx, apply); err != nil {
			return fmt.Errorf("handle %d events: %w", len(apply), err)
		}
	} else {
		for _, m := range apply {
			if err := in.h.HandleTx(ctx, tx, m); err != nil {
				return fmt.Errorf("handle event %s: %w", m.ID, err)
			}
		}
	}
	failpoint.Inject("inbox.before-commit")
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("inbox: commit: %w", err)
	}
	return nil
}

// fenceEpoch is the epoch of a partition lease value ("<epoch>|<holder>"),
// or 0 for none.
func fenceEpoch(fence string) (int64, error) {
	if fence == "" {
		return 0, nil
	}
	e, _, _ := strings.Cut(fence, "|")
	n, err := strconv.ParseInt(e, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("inbox: partition lease value %q has no epoch: %w", fence, err)
	}
	return n, nil
}

// Maintain deletes the event ids past the retention every CleanupInterval
// until ctx is cancelled (consumer.Maintainer: the consumer runs it).
func (in *Inbox) Maintain(ctx context.Context) {
	tick := time.NewTicker(in.cfg.CleanupInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		group, ok := in.group.Load().(string)
		if !ok {
			continue // no batch yet: the group is not known
		}
		if n, err := in.Cleanup(ctx, group); err != nil && ctx.Err() == nil {
			in.cfg.Logger.Warn("inbox cleanup failed; retrying at the next interval", slog.Any("error", err))
		} else if n > 0 {
			in.cfg.Logger.Debug("inbox cleaned", slog.Int64("deleted", n), slog.String("group", group))
		}
	}
}

// Cleanup deletes the event ids of group recorded longer than the retention
// ago by the database's clock (the one that stamped them), CleanupBatch at a
// time, each batch its own short transaction, and returns how many it
// deleted.
func (in *Inbox) Cleanup(ctx context.Context, group string) (int64, error) {
	var total int64
	for {
		st := queries.InboxCleanup(group, in.cfg.Retention, int64(in.cfg.CleanupBatch))
		tag, err := in.db.Exec(ctx, st.SQL, st.Args...)
		if err != nil {
			return total, fmt.Errorf("inbox cleanup: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(in.cfg.CleanupBatch) {
			return total, nil
		}
	}
}
