package admin

import (
	"context"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/internal/queries"
)

// RepublishResult is what Republish did.
type RepublishResult struct {
	Republished []uuid.UUID   // published events now pending again
	Skipped     []NotRequeued // ids that were not published (or unknown), left alone
}

// Republish puts the published events among ids back to pending, so that
// the relays publish them again, and records each in outbox_republished
// with by, reason and the stream entry it had. It is the repair for events
// a broker lost after the relays marked them published (outbox reconcile's
// not_in_stream): a Redis restarted without its append-only file, a
// failover to a replica that did not have the entries.
//
// Each one goes back with its own seq, so it is published before the later
// events of its key (the rule for requeued dead events, docs/design.md), and
// its redelivery window starts again. Consumers apply it once: their dedupe
// records skip it if they still have it, and apply it if they lost it with
// the entry. Republishing an event whose entry is still in the stream and
// whose dedupe record is gone would apply it twice: republish only what
// reconcile reports lost. Rows in any other status are never touched; they
// are reported in Skipped. It is one statement: all of them or none.
func Republish(ctx context.Context, pool *pgxpool.Pool, ids []uuid.UUID, by, reason string) (RepublishResult, error) {
	var res RepublishResult
	switch {
	case by == "":
		return res, errors.New("republish: say who republishes (by)")
	case reason == "":
		return res, errors.New("republish: say why (reason)")
	case len(ids) == 0:
		return res, nil
	}
	var err error
	res.Republished, res.Skipped, err = requeue(ctx, pool, queries.AdminRepublish(ids, by, reason))
	if err != nil {
		return RepublishResult{}, fmt.Errorf("republish: %w", err)
	}
	return res, nil
}
