package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/user"

	"github.com/google/uuid"

	"github.com/tedbank/outbox/admin"
	"github.com/tedbank/outbox/reconcile"
)

// runRepublish puts published events a broker lost back to pending
// (admin.Republish), by id or every id a reconcile report lists as lost.
func runRepublish(ctx context.Context, e *env, args []string) error {
	var c common
	fs := e.flags("republish", &c)
	usageLine(fs, "outbox republish --reason TEXT [--by NAME] (<event-id>... | --report FILE)")
	reason := fs.String("reason", "", "why the events are republished (required; kept in outbox_republished)")
	by := fs.String("by", defaultOperator(), "who republishes (kept in outbox_republished)")
	report := fs.String("report", "", "republish every event this report lists as lost: the output of 'outbox reconcile --json --list-lost' (- for standard input)")
	asJSON := fs.Bool("json", false, `print {"republished":[ids],"skipped":[{"event_id":...,"status":...}]}`)
	rawIDs, err := e.parseWithArgs(fs, args)
	if err != nil {
		return err
	}
	switch {
	case *reason == "":
		return usagef("say why with --reason (it is kept with each event republished)")
	case *by == "":
		return usagef("say who republishes with --by")
	case *report != "" && len(rawIDs) > 0:
		return usagef("give event ids or --report, not both")
	case *report == "" && len(rawIDs) == 0:
		return usagef("give the event ids to republish, or --report with a reconcile report")
	}
	if *report != "" {
		if rawIDs, err = lostIDs(*report); err != nil {
			return err
		}
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
	res, err := admin.Republish(ctx, pool, ids, *by, *reason)
	if err != nil {
		return err
	}
	if *asJSON {
		type skipped struct {
			EventID uuid.UUID `json:"event_id"`
			Status  string    `json:"status"`
		}
		out := struct {
			Republished []uuid.UUID `json:"republished"`
			Skipped     []skipped   `json:"skipped"`
		}{Republished: res.Republished, Skipped: []skipped{}}
		if out.Republished == nil {
			out.Republished = []uuid.UUID{}
		}
		for _, s := range res.Skipped {
			out.Skipped = append(out.Skipped, skipped{s.EventID, s.Status})
		}
		return json.NewEncoder(e.stdout).Encode(out)
	}
	n := int64(len(res.Republished))
	fmt.Fprintf(e.stdout, "republished %d %s (back to pending; the relays publish them again)\n", n, plural(n, "event", "events"))
	if len(res.Skipped) > 0 {
		why := make([]string, len(res.Skipped))
		for i, s := range res.Skipped {
			if s.Status == "" {
				why[i] = fmt.Sprintf("%s does not exist", s.EventID)
			} else {
				why[i] = fmt.Sprintf("%s is %s, not published", s.EventID, s.Status)
			}
		}
		return fmt.Errorf("%d of %d events not republished (only published events are): %s",
			len(res.Skipped), len(res.Skipped)+len(res.Republished), list(why, 10))
	}
	return nil
}

// lostIDs reads the lost event ids of a reconcile report (path, or - for
// standard input).
func lostIDs(path string) ([]string, error) {
	var r io.Reader = os.Stdin
	if path != "-" {
		f, err := os.Open(path)
		if err != nil {
			return nil, usagef("--report: %v", err)
		}
		defer f.Close()
		r = f
	}
	var rep reconcile.Report
	if err := json.NewDecoder(r).Decode(&rep); err != nil {
		return nil, usagef("--report %s: not a reconcile report (outbox reconcile --json --list-lost): %v", path, err)
	}
	if rep.NotInStream.Count > 0 && len(rep.Lost) != rep.NotInStream.Count {
		return nil, usagef("--report %s lists %d of its %d lost events: run outbox reconcile --json --list-lost",
			path, len(rep.Lost), rep.NotInStream.Count)
	}
	return rep.Lost, nil
}

// defaultOperator is user@host, for --by.
func defaultOperator() string {
	name := "unknown"
	if u, err := user.Current(); err == nil && u.Username != "" {
		name = u.Username
	}
	host, _ := os.Hostname()
	return name + "@" + host
}
