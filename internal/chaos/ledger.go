package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/ledger"
)

// The inbox path runs under the same faults as anti-fraud: two ledger
// consumers (outbox ledger: a double entry per TED in a database of their
// own, exactly once through the inbox) read the stream as a second group,
// are killed with the anti-fraud consumers, and meet transient failures of
// their own: now and then a receiving account is made "flaky" for a while,
// and a trigger fails every posting to it with lock_not_available (55P03),
// as a row lock held elsewhere would. A sender's TED to a flaky account
// fails while its next ones, to other accounts, could succeed: they must
// wait for it. The end checks every TED posted once, each sender's in
// settled order.

// ledgerFlaky is the ledger database's fault: the table of flaky accounts
// and the trigger that fails their postings.
const ledgerFlaky = `
CREATE TABLE chaos_flaky (account text PRIMARY KEY, until timestamptz NOT NULL);
CREATE FUNCTION chaos_flaky_posting() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM chaos_flaky WHERE account = NEW.account AND until > now()) THEN
        RAISE EXCEPTION 'chaos: account % is flaky', NEW.account USING ERRCODE = 'lock_not_available';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER chaos_flaky BEFORE INSERT ON ledger_entries FOR EACH ROW EXECUTE FUNCTION chaos_flaky_posting();`

// setupLedger creates and migrates the ledger's database, with the flaky
// accounts' trigger.
func (r *run) setupLedger(ctx context.Context, url string) error {
	db, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	if err := ledger.Migrate(ctx, db); err != nil {
		db.Close()
		return fmt.Errorf("migrate the ledger's database: %w", err)
	}
	if _, err := db.Exec(ctx, ledgerFlaky); err != nil {
		db.Close()
		return fmt.Errorf("the ledger's flaky accounts: %w", err)
	}
	r.ledgerDB = db
	return nil
}

// flakyLoop makes a random receiving account flaky for 1-2 s every few
// seconds while the load runs.
func (r *run) flakyLoop(ctx context.Context, accounts int) {
	rng := rand.New(rand.NewPCG(r.cfg.Seed, 23))
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.settleDone:
			return
		case <-time.After(time.Duration(2000+rng.IntN(3000)) * time.Millisecond):
		}
		acct := fmt.Sprintf("acct-%04d", rng.IntN(accounts))
		d := time.Duration(1000+rng.IntN(1000)) * time.Millisecond
		if _, err := r.ledgerDB.Exec(ctx, `INSERT INTO chaos_flaky (account, until) VALUES ($1, now() + $2 * interval '1 millisecond')
			ON CONFLICT (account) DO UPDATE SET until = EXCLUDED.until`, acct, d.Milliseconds()); err == nil {
			r.flaky++
		}
	}
}

// ledgerCount is how many TEDs the ledger has posted (a transfer with a
// debit).
func (r *run) ledgerCount(ctx context.Context) (int, error) {
	var n int
	err := r.ledgerDB.QueryRow(ctx, `SELECT count(DISTINCT transfer_id) FROM ledger_entries WHERE amount_cents < 0`).Scan(&n)
	return n, err
}

// checkLedger checks that every TED was posted once, each sender's in
// settled order, and returns how many senders' were not in order.
func (r *run) checkLedger(ctx context.Context, want map[string][]string) int {
	rows, err := r.ledgerDB.Query(ctx, `SELECT transfer_id::text, account FROM ledger_entries WHERE amount_cents < 0 ORDER BY entry_id`)
	if err != nil {
		r.problem("read the ledger: %v", err)
		return 0
	}
	got := map[string][]string{}
	posted := map[string]int{}
	for rows.Next() {
		var id, from string
		if err := rows.Scan(&id, &from); err != nil {
			r.problem("read the ledger: %v", err)
			return 0
		}
		got[from] = append(got[from], id)
		posted[id]++
	}
	rows.Close()
	lost, doubled := 0, 0
	for _, ids := range want {
		for _, id := range ids {
			switch posted[id] {
			case 0:
				lost++
			case 1:
			default:
				doubled++
			}
		}
	}
	if lost > 0 || doubled > 0 {
		r.problem("ledger (inbox path): %d TEDs never posted, %d posted more than once", lost, doubled)
	}
	outOfOrder := 0
	for sender, ids := range want {
		if !slices.Equal(got[sender], ids) {
			outOfOrder++
			if outOfOrder <= 3 {
				r.detail("ledger: sender %s: posted %d of %d TEDs, not in settled order", sender, len(got[sender]), len(ids))
			}
		}
	}
	if outOfOrder > 0 {
		r.problem("%d senders' TEDs were not posted once each in settled order by the ledger (inbox path)", outOfOrder)
	}
	r.logf("ledger (inbox path): %d TEDs posted, %d accounts made flaky during the load, %d senders out of order",
		len(posted), r.flaky, outOfOrder)
	return outOfOrder
}
