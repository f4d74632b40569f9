package cli

// 'outbox dead list|retry': the outbox's dead events.

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/admin"
	"github.com/tedbank/outbox/internal/connect"
)

const defaultDeadListLimit = 100

func runDead(ctx context.Context, e *env, args []string) error {
	return e.dispatch(ctx, "dead", []subcommand{
		{"list", "list the dead events (rows of outbox_messages with status dead)", runDeadList},
		{"retry", "requeue dead events: back to pending, attempts reset", runDeadRetry},
	}, args)
}

func deadPool(ctx context.Context, c *common) (*pgxpool.Pool, error) {
	return openOutbox(ctx, c.databaseURL, connect.PostgresOptions{AppName: "outbox-dead", MaxConns: 2})
}

func runDeadList(ctx context.Context, e *env, args []string) error {
	var c common
	fs := e.flags("dead list", &c)
	usageLine(fs, "outbox dead list [--json] [--limit N]")
	asJSON := fs.Bool("json", false, "print a JSON array, one object per dead event")
	limit := fs.Int("limit", defaultDeadListLimit, "list at most this many dead events, oldest first")
	if err := e.parse(fs, args); err != nil {
		return err
	}
	if _, err := c.logger(e.stderr); err != nil {
		return err
	}
	if *limit <= 0 {
		return usagef("--limit %d: must be positive", *limit)
	}
	pool, err := deadPool(ctx, &c)
	if err != nil {
		return err
	}
	defer pool.Close()
	events, total, err := admin.ListDead(ctx, pool, *limit)
	if err != nil {
		return err
	}
	if *asJSON {
		return json.NewEncoder(e.stdout).Encode(events)
	}
	if len(events) == 0 {
		fmt.Fprintln(e.stdout, "no dead events")
		return nil
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "EVENT ID\tAGGREGATE\tEVENT TYPE\tATTEMPTS\tCREATED\tLAST ERROR")
	for _, d := range events {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\n", d.EventID, cell(d.AggregateType+"/"+d.AggregateID, 40),
			cell(d.EventType, 30), d.Attempts, d.CreatedAt.UTC().Format(time.RFC3339), cellEnds(d.LastError, 120))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	listFooter(e.stdout, len(events), total, "event", "--limit")
	return nil
}

func runDeadRetry(ctx context.Context, e *env, args []string) error {
	var c common
	fs := e.flags("dead retry", &c)
	usageLine(fs, "outbox dead retry <event-id>... | --all")
	all := fs.Bool("all", false, "requeue every dead event")
	batch := fs.Int("batch", admin.DefaultRetryBatch, "with --all: rows requeued per statement")
	rawIDs, err := e.parseWithArgs(fs, args)
	if err != nil {
		return err
	}
	log, err := c.logger(e.stderr)
	if err != nil {
		return err
	}
	switch {
	case *all && len(rawIDs) > 0:
		return usagef("give event ids or --all, not both")
	case !*all && len(rawIDs) == 0:
		return usagef("give the event ids to requeue, or --all")
	case *batch <= 0:
		return usagef("--batch %d: must be positive", *batch)
	}
	ids, err := eventIDs(rawIDs)
	if err != nil {
		return err
	}
	pool, err := deadPool(ctx, &c)
	if err != nil {
		return err
	}
	defer pool.Close()

	if *all {
		n, err := admin.RetryAllDead(ctx, pool, *batch)
		if n > 0 || err == nil {
			fmt.Fprintf(e.stdout, "requeued %d dead %s\n", n, plural(n, "event", "events"))
		}
		return err
	}
	res, err := admin.RetryDead(ctx, pool, ids)
	if err != nil {
		return err
	}
	for _, id := range res.Requeued {
		log.Debug("dead event requeued", slog.String("event_id", id.String()))
	}
	n := int64(len(res.Requeued))
	fmt.Fprintf(e.stdout, "requeued %d dead %s\n", n, plural(n, "event", "events"))
	if len(res.Skipped) > 0 {
		why := make([]string, len(res.Skipped))
		for i, s := range res.Skipped {
			why[i] = s.String()
		}
		return fmt.Errorf("%d of %d events not requeued (only dead events are): %s",
			len(res.Skipped), len(res.Skipped)+len(res.Requeued), list(why, 10))
	}
	return nil
}

// eventIDs parses the event ids given on a command line.
func eventIDs(raw []string) ([]uuid.UUID, error) {
	ids := make([]uuid.UUID, len(raw))
	for i, s := range raw {
		var err error
		if ids[i], err = uuid.Parse(s); err != nil {
			return nil, usagef("event id %q is not a UUID", s)
		}
	}
	return ids, nil
}
