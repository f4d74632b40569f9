package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/connect"
	"github.com/tedbank/outbox/reconcile"
)

func runReconcile(ctx context.Context, e *env, args []string) error {
	var c common
	since, grace := ageValue(reconcile.DefaultSince), ageValue(reconcile.DefaultGrace)
	fs := e.flags("reconcile", &c)
	usageLine(fs, "outbox reconcile [--since D] [--grace D] [--json]")
	fs.Var(&since, "since", "check the transfers settled in the last `duration`, e.g. 24h or 7d (keep it within the outbox's retention: cleanup deletes old events)")
	fs.Var(&grace, "grace", "events younger than this `duration` may still be on their way and are not reported")
	stream := fs.String("stream", fraud.DefaultStream, "stream the relay publishes transfer events to")
	keyPrefix := fs.String("key-prefix", fraud.DefaultKeyPrefix, "anti-fraud key prefix")
	retention := fs.Duration("retention", fraud.DefaultRetention, "anti-fraud's --retention: verdicts older than it have expired and are not looked for")
	partitions := partitionsFlag(e, fs, "the partitions of the stream and of anti-fraud's state, as the relays and consumers run them")
	ledgerURL := ledgerDatabaseFlag(e, fs, "also check the ledger example's database: every published transfer posted exactly once (off when empty)")
	asJSON := fs.Bool("json", false, "print the report as JSON")
	listLost := fs.Bool("list-lost", false, "list every lost event (not_in_stream) in the report's \"lost\", not only the first few: what 'outbox republish --report' takes")
	if err := e.parse(fs, args); err != nil {
		return err
	}
	if _, err := c.logger(e.stderr); err != nil {
		return err
	}
	parts, err := partitions()
	if err != nil {
		return err
	}
	if c.redisCluster && parts < 2 {
		return usagef("--partitions %d: on a Redis Cluster anti-fraud's state has at least 2 partitions (each sender's keys in one slot); give the consumers' --partitions", parts)
	}
	switch {
	case time.Duration(since) <= 0:
		return usagef("--since %s: must be positive", time.Duration(since))
	case time.Duration(grace) < 0:
		return usagef("--grace %s: must not be negative", time.Duration(grace))
	}
	if err := (fraud.Config{Config: consumer.Config{Stream: *stream, KeyPrefix: *keyPrefix, Consumer: "reconcile", Partitions: parts}, Retention: *retention}).Validate(); err != nil {
		return usagef("%v", err)
	}
	pool, err := openOutbox(ctx, c.databaseURL, connect.PostgresOptions{AppName: "outbox-reconcile", MaxConns: 2})
	if err != nil {
		return err
	}
	defer pool.Close()
	rdb, err := c.redis(ctx, connect.RedisOptions{ClientName: "outbox-reconcile"})
	if err != nil {
		return err
	}
	defer rdb.Close()
	var ledgerDB *pgxpool.Pool
	if *ledgerURL != "" {
		if ledgerDB, err = openLedger(ctx, *ledgerURL, "outbox-reconcile"); err != nil {
			return err
		}
		defer ledgerDB.Close()
	}
	now := time.Now()
	g := time.Duration(grace)
	if g == 0 {
		g = time.Nanosecond // 0 means "no grace", not the default
	}
	rep, err := reconcile.Run(ctx, pool, rdb, reconcile.Options{
		Since: now.Add(-time.Duration(since)), Grace: g, Stream: *stream, KeyPrefix: *keyPrefix, Now: now,
		Retention: *retention, Partitions: parts, Ledger: ledgerDB, ListLost: *listLost,
	})
	if err != nil {
		return err
	}
	if *asJSON {
		if err := json.NewEncoder(e.stdout).Encode(rep); err != nil {
			return err
		}
	} else {
		printReconcile(e.stdout, rep)
	}
	if !rep.OK {
		return fmt.Errorf("differences found (%s)", strings.Join(differences(rep), ", "))
	}
	return nil
}

// differences names each kind of difference in rep with its count.
func differences(rep reconcile.Report) []string {
	type kind struct {
		name string
		n    int
	}
	kinds := []kind{
		{"transfers without their event", rep.MissingEvent.Count},
		{"events without their transfer", rep.Orphan.Count},
		{"events not published", rep.Unpublished.Count},
		{"published events without a verdict", rep.NoVerdict.Count},
		{"published events gone from the stream without a verdict", rep.NotInStream.Count},
		{"senders whose anti-fraud totals differ", rep.TotalsDiffer},
	}
	if l := rep.Ledger; l != nil {
		kinds = append(kinds, kind{"published transfers not in the ledger", l.NotPosted.Count},
			kind{"transfers posted more than once", l.Doubled.Count}, kind{"transfers posted with wrong entries", l.Wrong.Count})
	}
	var out []string
	for _, d := range kinds {
		if d.n > 0 {
			out = append(out, fmt.Sprintf("%d %s", d.n, d.name))
		}
	}
	return out
}

func printReconcile(w io.Writer, rep reconcile.Report) {
	fmt.Fprintf(w, "checked %d transfers, %d events and %d senders settled since %s (grace %s)\n",
		rep.Transfers, rep.Events, rep.Senders, rep.Since.Format(time.RFC3339), rep.Grace)
	line := func(name string, d reconcile.Diff, hint string) {
		if d.Count == 0 {
			return
		}
		ex := d.Examples[:min(len(d.Examples), 3)]
		fmt.Fprintf(w, "%-38s %d  e.g. %s\n  %s\n", name, d.Count, strings.Join(ex, " "), hint)
	}
	missing := "the business row committed without its outbox row: a writer bypassed transfer.Settle"
	if rep.CleanupHorizon != nil {
		missing += fmt.Sprintf(" (or, settled before the cleanup horizon %s, its event was cleaned up before anti-fraud judged it)",
			rep.CleanupHorizon.Format(time.RFC3339))
	}
	line("transfers without their event", rep.MissingEvent, missing)
	line("events without their transfer", rep.Orphan, "an outbox row whose transfer is gone (deleted, or outside --since by a clock skew)")
	line("events not published", rep.Unpublished, "relays down or failing: outbox status, outbox dead list")
	line("published, no verdict yet", rep.NoVerdict, "the entry is in the stream: anti-fraud is behind or stuck (outbox status: group lag/pending)")
	line("published, gone from the stream", rep.NotInStream, "deleted or lost before anti-fraud read it: republish them (outbox reconcile --json --list-lost > lost.json; outbox republish --report lost.json --reason ...)")
	if rep.CleanedUp > 0 {
		fmt.Fprintf(w, "%d transfers settled before the cleanup horizon %s have no event row left (outbox cleanup deleted it): judged by anti-fraud, or past its retention and not checkable; retention, not a difference\n",
			rep.CleanedUp, rep.CleanupHorizon.Format(time.RFC3339))
	}
	if rep.PastRetention > 0 {
		fmt.Fprintf(w, "%d published events settled too long ago to still have a verdict (anti-fraud --retention) were not looked up\n", rep.PastRetention)
	}
	for _, d := range rep.SenderDiffs {
		fmt.Fprintf(w, "totals differ: %s anti-fraud %d cents in %d transfers, PostgreSQL %d cents in %d (judged transfers)\n",
			d.Account, d.FraudCents, d.FraudTransfers, d.WantCents, d.WantTransfers)
	}
	if rep.TotalsDiffer > len(rep.SenderDiffs) {
		fmt.Fprintf(w, "... and %d more senders whose totals differ\n", rep.TotalsDiffer-len(rep.SenderDiffs))
	}
	if l := rep.Ledger; l != nil {
		fmt.Fprintf(w, "ledger: checked %d published transfers\n", l.Checked)
		line("published, not in the ledger", l.NotPosted, "the ledger consumer is behind or stuck (outbox status; its logs)")
		line("posted more than once", l.Doubled, "an effect applied twice: the inbox must record each event id in the posting's transaction")
		line("posted with wrong entries", l.Wrong, "entries that are not the transfer's debit and credit: written by something else than the ledger")
	}
	if rep.OK {
		fmt.Fprintln(w, "ok: nothing differs")
	}
}
