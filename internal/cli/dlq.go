package cli

// 'outbox dlq list|retry': a consumer group's dead letters, any consumer's
// (--key-prefix); 'outbox fraud dlq list|retry' is the same, its first name.

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/tedbank/outbox/admin/dlq"
	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/connect"
)

const defaultDLQListCount = 100

func runFraudDLQ(ctx context.Context, e *env, args []string) error {
	return runDLQAs(ctx, e, "fraud dlq", args)
}

func runDLQ(ctx context.Context, e *env, args []string) error { return runDLQAs(ctx, e, "dlq", args) }

// runDLQAs runs the dead-letter commands under name ("dlq", or its first
// name, "fraud dlq").
func runDLQAs(ctx context.Context, e *env, name string, args []string) error {
	return e.dispatch(ctx, name, []subcommand{
		{"list", "list a consumer group's dead letters (<key-prefix>dlq; anti-fraud's by default)", func(ctx context.Context, e *env, args []string) error {
			return runDLQList(ctx, e, name, args)
		}},
		{"retry", "put dead letters back on their source stream", func(ctx context.Context, e *env, args []string) error {
			return runDLQRetry(ctx, e, name, args)
		}},
	}, args)
}

func keyPrefixFlag(fs *flag.FlagSet) *string {
	return fs.String("key-prefix", fraud.DefaultKeyPrefix, "key prefix of the consumers; the dead-letter stream is <key-prefix>dlq")
}

// checkNames validates a key prefix and stream name as the consumer does.
func checkNames(keyPrefix, stream string) error {
	if err := (fraud.Config{Config: consumer.Config{KeyPrefix: keyPrefix, Stream: stream, Consumer: "admin"}}).Validate(); err != nil {
		return usageError{err.Error()}
	}
	return nil
}

func runDLQList(ctx context.Context, e *env, name string, args []string) error {
	var c common
	fs := e.flags(name+" list", &c)
	usageLine(fs, "outbox "+name+" list [--json] [--key-prefix P] [--count N] [--partitions N]")
	asJSON := fs.Bool("json", false, "print a JSON array, one object per dead letter")
	prefix := keyPrefixFlag(fs)
	count := fs.Int("count", defaultDLQListCount, "list at most this many dead letters, oldest first")
	partitions := partitionsFlag(e, fs, "the partitions of the consumers' state: each has its dead-letter stream, listed together")
	if err := e.parse(fs, args); err != nil {
		return err
	}
	nParts, err := partitions()
	if err != nil {
		return err
	}
	if _, err := c.logger(e.stderr); err != nil {
		return err
	}
	if *count <= 0 {
		return usagef("--count %d: must be positive", *count)
	}
	if err := checkNames(*prefix, ""); err != nil {
		return err
	}
	rdb, err := c.redis(ctx, connect.RedisOptions{ClientName: "outbox-fraud-dlq"})
	if err != nil {
		return err
	}
	defer rdb.Close()
	letters, total, err := dlq.ListPartitions(ctx, rdb, *prefix, nParts, *count)
	if err != nil {
		return err
	}
	if *asJSON {
		return json.NewEncoder(e.stdout).Encode(letters)
	}
	if len(letters) == 0 {
		where := dlq.Stream(*prefix)
		if nParts > 1 {
			where = fmt.Sprintf("the %d partitions' dead-letter streams", nParts)
		}
		fmt.Fprintf(e.stdout, "no dead letters in %s\n", where)
		return nil
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tEVENT ID\tEVENT TYPE\tSOURCE\tDELIVERIES\tREASON")
	for _, d := range letters {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\n", d.ID, orDash(cell(d.EventID, 40)), orDash(cell(d.EventType, 30)),
			orDash(cell(d.Stream+" "+d.EntryID, 60)), d.Deliveries, cellEnds(d.Reason, 120))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	listFooter(e.stdout, len(letters), total, "letter", "--count")
	return nil
}

func runDLQRetry(ctx context.Context, e *env, name string, args []string) error {
	var c common
	fs := e.flags(name+" retry", &c)
	usageLine(fs, "outbox "+name+" retry <dlq-entry-id>... | --all")
	all := fs.Bool("all", false, "retry every dead letter")
	prefix := keyPrefixFlag(fs)
	stream := fs.String("stream", fraud.DefaultStream, "source stream of dead letters without a dlq_stream field")
	partitions := partitionsFlag(e, fs, "the partitions of the consumers' state: an id is looked up in each partition's dead-letter stream")
	ids, err := e.parseWithArgs(fs, args)
	if err != nil {
		return err
	}
	nParts, err := partitions()
	if err != nil {
		return err
	}
	log, err := c.logger(e.stderr)
	if err != nil {
		return err
	}
	switch {
	case *all && len(ids) > 0:
		return usagef("give dead-letter ids or --all, not both")
	case !*all && len(ids) == 0:
		return usagef("give the dead-letter ids to retry (see 'outbox %s list'), or --all", name)
	}
	for _, id := range ids {
		if !dlq.ValidEntryID(id) {
			return usagef("dead-letter id %q is not a stream entry id like 1700000000000-0", id)
		}
	}
	if err := checkNames(*prefix, *stream); err != nil {
		return err
	}
	rdb, err := c.redis(ctx, connect.RedisOptions{ClientName: "outbox-fraud-dlq", NoRetries: true})
	if err != nil {
		return err
	}
	defer rdb.Close()
	res, err := dlq.RetryPartitions(ctx, rdb, *prefix, nParts, ids, *all, *stream)
	var streams []string
	for _, r := range res.Retried {
		log.Debug("dead letter retried", slog.String("dlq_id", r.ID), slog.String("stream", r.Stream), slog.String("entry_id", r.NewID))
		if !slices.Contains(streams, r.Stream) {
			streams = append(streams, r.Stream)
		}
	}
	n := int64(len(res.Retried))
	if n > 0 {
		fmt.Fprintf(e.stdout, "retried %d dead %s (re-added to %s)\n", n, plural(n, "letter", "letters"), strings.Join(streams, ", "))
	} else if err == nil {
		fmt.Fprintln(e.stdout, "retried 0 dead letters")
	}
	if err != nil {
		return err
	}
	var why []string
	for _, id := range res.Missing {
		where := dlq.Stream(*prefix)
		if nParts > 1 {
			where = fmt.Sprintf("any of the %d partitions' dead-letter streams", nParts)
		}
		why = append(why, id+" is not in "+where)
	}
	for _, f := range res.Failed {
		why = append(why, fmt.Sprintf("%s: %v", f.ID, f.Err))
	}
	if len(why) > 0 {
		return fmt.Errorf("%d dead %s not retried: %s", len(why), plural(int64(len(why)), "letter", "letters"), list(why, 10))
	}
	return nil
}
