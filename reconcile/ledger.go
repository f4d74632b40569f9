package reconcile

import (
	"context"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/internal/queries"
)

// LedgerReport is what the ledger check found: of the published transfers
// past the grace period (Checked), those without entries in the ledger
// (NotPosted: the ledger consumer is behind or stuck), posted more than once
// (Doubled: an effect applied twice), and posted with entries that are not
// the transfer's double entry (Wrong).
type LedgerReport struct {
	Checked   int  `json:"checked"`
	NotPosted Diff `json:"not_posted"`
	Doubled   Diff `json:"posted_twice"`
	Wrong     Diff `json:"wrong_entries"`
}

func newLedgerReport() *LedgerReport {
	return &LedgerReport{NotPosted: Diff{Examples: []string{}}, Doubled: Diff{Examples: []string{}}, Wrong: Diff{Examples: []string{}}}
}

// ok: nothing differs (or the ledger was not checked).
func (l *LedgerReport) ok() bool {
	return l == nil || l.NotPosted.Count == 0 && l.Doubled.Count == 0 && l.Wrong.Count == 0
}

// posting is one ledger entry.
type posting struct {
	account string
	cents   int64
}

// checkLedger looks up the entries of the transfers rs in the ledger.
func checkLedger(ctx context.Context, db *pgxpool.Pool, rs []row, rep *LedgerReport) error {
	ids := make([]uuid.UUID, len(rs))
	for i, r := range rs {
		id, err := uuid.Parse(*r.TransferID)
		if err != nil {
			return fmt.Errorf("transfer id %q: %w", *r.TransferID, err)
		}
		ids[i] = id
	}
	q := queries.LedgerPostings(ids)
	rows, err := db.Query(ctx, q.SQL, q.Args...)
	if err != nil {
		return fmt.Errorf("read ledger entries: %w", err)
	}
	entries := map[uuid.UUID][]posting{}
	for rows.Next() {
		var id uuid.UUID
		var p posting
		if err := rows.Scan(&id, &p.account, &p.cents); err != nil {
			rows.Close()
			return fmt.Errorf("read ledger entries: %w", err)
		}
		entries[id] = append(entries[id], p)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read ledger entries: %w", err)
	}
	for i, r := range rs {
		rep.Checked++
		got := entries[ids[i]]
		debit := posting{*r.FromAccount, -*r.AmountCents}
		credit := posting{*r.ToAccount, *r.AmountCents}
		switch {
		case len(got) == 0:
			rep.NotPosted.add(*r.TransferID)
		case len(got)%2 == 0 && len(got) > 2 && allDoubleEntries(got, debit, credit):
			rep.Doubled.add(*r.TransferID)
		case len(got) != 2 || !allDoubleEntries(got, debit, credit):
			rep.Wrong.add(*r.TransferID)
		}
	}
	return nil
}

// allDoubleEntries: got is the double entry (debit, credit), once or more.
func allDoubleEntries(got []posting, debit, credit posting) bool {
	var debits, credits int
	for _, p := range got {
		switch p {
		case debit:
			debits++
		case credit:
			credits++
		default:
			return false
		}
	}
	return debits == credits
}
