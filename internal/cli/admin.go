package cli

// The admin commands: 'outbox dead list|retry', 'outbox fraud dlq list|retry'
// and 'outbox cleanup'. The work itself is in internal/admin.

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/admin"
	"github.com/tedbank/outbox/internal/connect"
	"github.com/tedbank/outbox/partition"
)

const (
	defaultDeadListLimit = 100
	defaultDLQListCount  = 100
)

// subcommand is one verb of a command group such as 'outbox dead'.
type subcommand struct {
	name, summary string
	run           func(ctx context.Context, e *env, args []string) error
}

// dispatch runs the subcommand args[0] of the group parent.
func (e *env) dispatch(ctx context.Context, parent string, subs []subcommand, args []string) error {
	names := make([]string, len(subs))
	for i, s := range subs {
		names[i] = s.name
	}
	quoted := make([]string, len(names))
	for i, n := range names {
		quoted[i] = "'" + parent + " " + n + "'"
	}
	want := strings.Join(quoted, " or ")
	e.cmd = parent
	if len(args) == 0 {
		return usagef("missing subcommand: want %s", want)
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		fmt.Fprintf(e.stderr, "usage: outbox %s <%s> [flags]\n\n", parent, strings.Join(names, "|"))
		for _, s := range subs {
			fmt.Fprintf(e.stderr, "  %-6s %s\n", s.name, s.summary)
		}
		fmt.Fprintf(e.stderr, "\nRun 'outbox %s <subcommand> -h' for its flags.\n", parent)
		return flag.ErrHelp
	}
	for _, s := range subs {
		if s.name == args[0] {
			return s.run(ctx, e, args[1:])
		}
	}
	return usagef("unknown subcommand %q: want %s", args[0], want)
}

// parseWithArgs is parse for commands that take positional arguments: flags
// may come before, between or after them. Everything after "--" is positional.
func (e *env) parseWithArgs(fs *flag.FlagSet, args []string) ([]string, error) {
	fs.SetOutput(io.Discard)
	var pos []string
	for {
		err := fs.Parse(args)
		if errors.Is(err, flag.ErrHelp) {
			fs.SetOutput(e.stderr)
			fs.Usage()
			return nil, err
		}
		if err != nil {
			return nil, usageError{err.Error()}
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, nil
		}
		if used := len(args) - len(rest); used > 0 && args[used-1] == "--" {
			return append(pos, rest...), nil
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

func usageLine(fs *flag.FlagSet, line string) {
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: %s\n\nflags:\n", line)
		fs.PrintDefaults()
	}
}

// --- outbox dead --------------------------------------------------------------

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
			cell(d.EventType, 30), d.Attempts, d.CreatedAt.UTC().Format(time.RFC3339), cell(d.LastError, 80))
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
	ids := make([]uuid.UUID, len(rawIDs))
	for i, s := range rawIDs {
		if ids[i], err = uuid.Parse(s); err != nil {
			return usagef("event id %q is not a UUID", s)
		}
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

// --- outbox fraud dlq ------------------------------------------------------------

func runFraudDLQ(ctx context.Context, e *env, args []string) error {
	return e.dispatch(ctx, "fraud dlq", []subcommand{
		{"list", "list the anti-fraud consumer's dead letters (<key-prefix>dlq)", runFraudDLQList},
		{"retry", "put dead letters back on their source stream", runFraudDLQRetry},
	}, args)
}

func keyPrefixFlag(fs *flag.FlagSet) *string {
	return fs.String("key-prefix", fraud.DefaultKeyPrefix, "key prefix of the consumers; the dead-letter stream is <key-prefix>dlq")
}

// checkNames validates a key prefix and stream name as the consumer does.
func checkNames(keyPrefix, stream string) error {
	if err := (fraud.Config{KeyPrefix: keyPrefix, Stream: stream, Consumer: "admin"}).Validate(); err != nil {
		return usageError{err.Error()}
	}
	return nil
}

func runFraudDLQList(ctx context.Context, e *env, args []string) error {
	var c common
	fs := e.flags("fraud dlq list", &c)
	usageLine(fs, "outbox fraud dlq list [--json] [--key-prefix P] [--count N] [--partitions N]")
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
	var (
		letters = []admin.DeadLetter{} // an empty list prints as [], not null
		total   int64
	)
	for _, k := range (fraud.Keys{Prefix: *prefix, Partitions: nParts}).Each() {
		ls, n, err := admin.ListDeadLetters(ctx, rdb, k.Prefix, *count)
		if err != nil {
			return err
		}
		letters, total = append(letters, ls...), total+n
	}
	// Oldest first across the partitions' streams (entry ids are times).
	slices.SortStableFunc(letters, func(a, b admin.DeadLetter) int { return compareEntryIDs(a.ID, b.ID) })
	letters = letters[:min(len(letters), *count)]
	if *asJSON {
		return json.NewEncoder(e.stdout).Encode(letters)
	}
	if len(letters) == 0 {
		where := admin.DeadLetterStream(*prefix)
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
			orDash(cell(d.Stream+" "+d.EntryID, 60)), d.Deliveries, cell(d.Reason, 80))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	listFooter(e.stdout, len(letters), total, "letter", "--count")
	return nil
}

func runFraudDLQRetry(ctx context.Context, e *env, args []string) error {
	var c common
	fs := e.flags("fraud dlq retry", &c)
	usageLine(fs, "outbox fraud dlq retry <dlq-entry-id>... | --all")
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
		return usagef("give the dead-letter ids to retry (see 'outbox fraud dlq list'), or --all")
	}
	for _, id := range ids {
		if !admin.ValidEntryID(id) {
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
	var res admin.DLQRetryResult
	missing := map[string]int{} // how many partitions do not hold each id
	for p, k := range (fraud.Keys{Prefix: *prefix, Partitions: nParts}).Each() {
		var r admin.DLQRetryResult
		source := partition.Stream(*stream, p, nParts)
		if *all {
			r, err = admin.RetryAllDeadLetters(ctx, rdb, k.Prefix, source)
		} else {
			r, err = admin.RetryDeadLetters(ctx, rdb, k.Prefix, ids, source)
		}
		res.Retried, res.Failed = append(res.Retried, r.Retried...), append(res.Failed, r.Failed...)
		for _, id := range r.Missing {
			missing[id]++
		}
		if err != nil {
			break
		}
	}
	for _, id := range ids {
		if missing[id] == nParts && !slices.Contains(res.Missing, id) {
			res.Missing = append(res.Missing, id)
		}
	}
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
		where := admin.DeadLetterStream(*prefix)
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

// --- outbox cleanup ----------------------------------------------------------------

// ageValue is a duration flag that also takes whole days ("7d").
type ageValue time.Duration

func (a *ageValue) String() string {
	if a == nil || *a == 0 {
		return ""
	}
	return time.Duration(*a).String()
}

func (a *ageValue) Set(s string) error {
	if days, ok := strings.CutSuffix(s, "d"); ok {
		n, err := strconv.Atoi(days)
		if err != nil || n < 0 || n > 100_000 {
			return fmt.Errorf("%q: want a duration such as 720h, 30m or 7d", s)
		}
		*a = ageValue(time.Duration(n) * 24 * time.Hour)
		return nil
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("%q: want a duration such as 720h, 30m or 7d", s)
	}
	*a = ageValue(d)
	return nil
}

func runCleanup(ctx context.Context, e *env, args []string) error {
	var c common
	var olderThan ageValue
	fs := e.flags("cleanup", &c)
	usageLine(fs, "outbox cleanup --older-than D [--batch N] [--json]")
	fs.Var(&olderThan, "older-than", "delete rows published longer ago than this `duration`, e.g. 7d or 36h (required)")
	batch := fs.Int("batch", admin.DefaultCleanupBatch, "rows deleted per statement (each its own short transaction)")
	asJSON := fs.Bool("json", false, "print the result as JSON")
	if err := e.parse(fs, args); err != nil {
		return err
	}
	log, err := c.logger(e.stderr)
	if err != nil {
		return err
	}
	switch {
	case !isSet(fs, "older-than"):
		return usagef("--older-than is required (e.g. --older-than 7d)")
	case time.Duration(olderThan) < time.Microsecond:
		return usagef("--older-than %s: must be positive", time.Duration(olderThan))
	case *batch <= 0 || *batch > 100_000:
		return usagef("--batch %d: must be between 1 and 100000", *batch)
	}
	pool, err := openOutbox(ctx, c.databaseURL, connect.PostgresOptions{AppName: "outbox-cleanup", MaxConns: 2})
	if err != nil {
		return err
	}
	defer pool.Close()
	start := time.Now()
	lastInfo := start
	res, err := admin.Cleanup(ctx, pool, admin.CleanupOptions{
		OlderThan: time.Duration(olderThan),
		BatchSize: *batch,
		OnBatch: func(r admin.CleanupResult) {
			// Every batch at debug; at info every 10 seconds, so that a
			// long cleanup is seen to progress.
			level := slog.LevelDebug
			if time.Since(lastInfo) >= cleanupProgressEvery {
				level, lastInfo = slog.LevelInfo, time.Now()
			}
			log.Log(ctx, level, "cleanup progress", slog.Int("batches", r.Batches), slog.Int64("deleted", r.Deleted),
				slog.Float64("rows_per_s", float64(r.Deleted)/max(time.Since(start).Seconds(), 1e-9)))
		},
	})
	if err != nil {
		if res.Deleted > 0 {
			fmt.Fprintf(e.stdout, "deleted %d published rows before stopping\n", res.Deleted)
		}
		return err
	}
	if *asJSON {
		return json.NewEncoder(e.stdout).Encode(struct {
			admin.CleanupResult
			OlderThanSeconds float64 `json:"older_than_seconds"`
			ElapsedMS        int64   `json:"elapsed_ms"`
		}{res, time.Duration(olderThan).Seconds(), time.Since(start).Milliseconds()})
	}
	fmt.Fprintf(e.stdout, "deleted %d published %s (published before %s, older than %s) in %d %s, %s\n",
		res.Deleted, plural(res.Deleted, "row", "rows"), res.Cutoff.UTC().Format(time.RFC3339), time.Duration(olderThan),
		res.Batches, plural(int64(res.Batches), "batch", "batches"), time.Since(start).Round(time.Millisecond))
	return nil
}

// --- output helpers ----------------------------------------------------------------

// cell makes s one line of at most n runes, for a table cell.
func cell(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	r := []rune(s)
	return string(r[:n-1]) + "…"
}

func orDash(s string) string {
	if strings.TrimSpace(s) == "" {
		return "-"
	}
	return s
}

func plural(n int64, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

// list joins items with ", ", naming at most most of them.
func list(items []string, most int) string {
	if len(items) <= most {
		return strings.Join(items, ", ")
	}
	return strings.Join(items[:most], ", ") + fmt.Sprintf(" and %d more", len(items)-most)
}

// listFooter ends a listing: how many of how many dead things were shown.
func listFooter(w io.Writer, shown int, total int64, noun, limitFlag string) {
	if int64(shown) < total {
		fmt.Fprintf(w, "%d of %d dead %ss shown (%s)\n", shown, total, noun, limitFlag)
		return
	}
	fmt.Fprintf(w, "%d dead %s\n", total, plural(total, noun, noun+"s"))
}

// cleanupProgressEvery: how often a running cleanup logs its progress at info.
const cleanupProgressEvery = 10 * time.Second

// compareEntryIDs orders stream entry ids ("ms-seq") by time, then sequence.
func compareEntryIDs(a, b string) int {
	am, as, _ := strings.Cut(a, "-")
	bm, bs, _ := strings.Cut(b, "-")
	num := func(s string) uint64 { n, _ := strconv.ParseUint(s, 10, 64); return n }
	return cmp.Or(cmp.Compare(num(am), num(bm)), cmp.Compare(num(as), num(bs)))
}
