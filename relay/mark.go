package relay

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/tedbank/outbox/internal/pgerr"
	"github.com/tedbank/outbox/internal/queries"
)

// pendingMark is a published batch whose mark has not been sent yet: while
// draining, it rides in the next claim's round trip (one round trip and one
// commit per batch instead of two).
type pendingMark struct {
	ids       []uuid.UUID
	streamIDs []string
	seqs      []int64 // the rows' seqs: a read beside the mark leaves them out (partition leases)
	rows      []int   // each row's place in its claimed batch
	fence     fence   // what fences the mark: the batch's (ownership.go)
}

// add records row i of the batch.
func (m *pendingMark) add(i int, id uuid.UUID, seq int64, streamID string) {
	m.ids = append(m.ids, id)
	m.seqs = append(m.seqs, seq)
	m.streamIDs = append(m.streamIDs, streamID)
	m.rows = append(m.rows, i)
}

// failedRow is a row relay_mark_failed updated.
type failedRow struct {
	ID            uuid.UUID
	Attempts      int
	EventType     string
	AggregateType string
	AggregateID   string
	LastError     string
	Dead          bool
}

// markFailed records failed publishes of rows the claim token still owns and
// reports each row that went dead at ERROR: it will not be published again
// until an operator retries it (outbox dead retry), and the events of its
// aggregate after it wait for that.
func (r *Relay) markFailed(ctx context.Context, f *pendingMark, delays []int64) (int, error) {
	var (
		b    pgx.Batch
		rows []failedRow
		mark = f.fence.failed(f, delays, r.cfg.MaxAttempts)
	)
	queueRelayTx(&b)
	queue(&b, mark).Query(func(rs pgx.Rows) error {
		var err error
		rows, err = pgx.CollectRows(rs, pgx.RowToStructByName[failedRow])
		return err
	})
	if err := r.sendTx(ctx, &b); err != nil {
		return 0, err
	}
	for _, row := range rows {
		if row.Dead {
			r.log.Error("event dead: not published after max_attempts; retry it with 'outbox dead retry'",
				slog.String("event_id", row.ID.String()), slog.String("event_type", row.EventType),
				slog.String("aggregate_type", row.AggregateType), slog.String("aggregate_id", row.AggregateID),
				slog.Int("attempts", row.Attempts), slog.Int("max_attempts", r.cfg.MaxAttempts),
				slog.String("last_error", row.LastError))
		}
	}
	return len(rows), nil
}

// markPublished sends m's mark on its own and counts it in res. A mark the
// server ended to break a deadlock is sent again (markDeadlockTries in all):
// the restamp of a LISTEN connection that came back updates the same rows
// (relay_restamp.sql), and a mark given up leaves its rows claimed, and
// every later event of their keys waiting, until their lease runs out (a
// .ci/run's backlog test: 30 s).
func (r *Relay) markPublished(ctx context.Context, res *BatchResult, m *pendingMark) error {
	tag, err := r.exec(ctx, m.fence.published(m))
	for try := 1; try < markDeadlockTries && pgerr.Deadlocked(err); try++ {
		r.log.Info("a mark lost a deadlock; sending it again", slog.Int("rows", len(m.ids)))
		tag, err = r.exec(ctx, m.fence.published(m))
	}
	if err != nil {
		return fmt.Errorf("mark %d rows published: %w", len(m.ids), err)
	}
	r.notePublished(res, m, int(tag.RowsAffected()))
	return nil
}

// markDeadlockTries bounds the sends of one mark that lose deadlocks.
const markDeadlockTries = 3

// notePublished counts a mark that updated n of m's rows; the others were
// re-claimed by another relay after our lease expired (fenced).
func (r *Relay) notePublished(res *BatchResult, m *pendingMark, n int) {
	fenced := len(m.ids) - n
	res.Published += n
	res.Fenced += fenced
	r.stats.published.Add(int64(n))
	r.stats.fenced.Add(int64(fenced))
	r.cfg.Metrics.marked(n, fenced)
	if fenced > 0 {
		r.log.Warn("claim lost to another relay after publishing (its lease expired, or this relay's LISTEN connection was lost and it looked dead); duplicates left for consumers to skip",
			slog.Int("rows", fenced))
	}
}

// release gives rows back to pending without counting an attempt.
func (r *Relay) release(ctx context.Context, token uuid.UUID, ids []uuid.UUID, after time.Duration, cause error) (int, error) {
	reason := "released"
	if cause != nil {
		reason = truncate("released: "+cause.Error(), 1000)
	}
	tag, err := r.exec(ctx, queries.RelayRelease(ids, token, after.Milliseconds(), reason))
	if err != nil {
		return 0, fmt.Errorf("release %d rows: %w", len(ids), err)
	}
	return int(tag.RowsAffected()), nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}
