// Package cli implements the outbox command. Each subcommand parses its own
// flags, validates everything before touching a server, and reports failure as
// one line on stderr with a non-zero exit code.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/connect"
)

// Exit codes.
const (
	exitOK      = 0
	exitFailure = 1 // the command ran and failed (server unreachable, checks failed)
	exitUsage   = 2 // bad command line; nothing was done
)

const (
	defaultDatabaseURL = "postgres://postgres@localhost:5432/postgres?sslmode=disable"
	defaultRedisURL    = "redis://localhost:6379/0"
)

// usageError marks errors in the command line.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return usageError{fmt.Sprintf(format, args...)} }

type command struct {
	name    string
	summary string
	run     func(ctx context.Context, env *env, args []string) error
}

func commands() []command {
	return []command{
		{"migrate", "apply the schema migrations (idempotent, safe to run concurrently)", runMigrate},
		{"relay", "publish committed outbox events to Redis Streams (or NATS JetStream: --broker nats)", runRelay},
		{"fraud", "run the anti-fraud consumer; 'fraud report' prints its totals, 'fraud dlq list|retry' its dead letters", runFraud},
		{"dlq", "a consumer group's dead letters: 'dlq list|retry' (--key-prefix names the consumers; anti-fraud's by default)", runDLQ},
		{"ledger", "run the ledger example's consumer (double entries in its own PostgreSQL, exactly once); 'ledger balances' prints them", runLedger},
		{"settle", "settle random TEDs (a load generator)", runSettle},
		{"status", "is it being delivered? the outbox, the relays, the stream and the consumer group at a glance (exit 1: not delivered)", runStatus},
		{"console", "serve the operator's web console: the status live, dead events and dead letters requeued with an audit", runConsole},
		{"dead", "'dead list' shows dead events; 'dead retry <id>... | --all' requeues them", runDead},
		{"republish", "put published events a broker lost back to pending, audited: by id, or every one a 'reconcile --json --list-lost' report lists", runRepublish},
		{"cleanup", "delete published rows older than --older-than, in small batches", runCleanup},
		{"reconcile", "check that every settled TED has its event, published, judged, and in the senders' totals", runReconcile},
		{"demo", "walk through settled TEDs end to end", runDemo},
		{"bench", "measure: 'bench writers|latency|drain|consume|sustained' (see docs/benchmarks.md)", runBench},
	}
}

// env is what every subcommand gets.
type env struct {
	stdout, stderr io.Writer
	getenv         func(string) string
	// cmd is the (sub)command being run, e.g. "fraud dlq retry": errors
	// name it and point to its help.
	cmd string
}

// Main runs the command line args and returns the exit code.
func Main(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	e := &env{stdout: stdout, stderr: stderr, getenv: os.Getenv}
	return e.main(ctx, args)
}

func (e *env) main(ctx context.Context, args []string) int {
	stdout, stderr := e.stdout, e.stderr
	if len(args) == 0 || args[0] == "help" || args[0] == "-h" || args[0] == "--help" {
		e.usage(stdout)
		if len(args) == 0 {
			return exitUsage
		}
		return exitOK
	}
	for _, c := range commands() {
		if c.name != args[0] {
			continue
		}
		err := c.run(ctx, e, args[1:])
		switch {
		case err == nil:
			return exitOK
		case errors.Is(err, flag.ErrHelp), errors.Is(err, errStoppedWaiting):
			return exitOK
		case errors.As(err, new(usageError)):
			fmt.Fprintf(stderr, "outbox %s: %s (see 'outbox %s -h')\n", e.cmdName(c.name), connect.RedactSecrets(err.Error()), e.cmdName(c.name))
			return exitUsage
		default:
			// Last line of defence: whatever produced the error, no
			// credential it quotes reaches the terminal.
			fmt.Fprintf(stderr, "outbox %s: %s\n", e.cmdName(c.name), connect.RedactSecrets(oneLine(err)))
			return exitFailure
		}
	}
	if near := nearestCommand(args[0]); near != "" {
		fmt.Fprintf(stderr, "outbox: unknown command %q; did you mean %q? (see 'outbox help')\n", args[0], near)
		return exitUsage
	}
	fmt.Fprintf(stderr, "outbox: unknown command %q (see 'outbox help')\n", args[0])
	return exitUsage
}

// nearestCommand is the command name within two edits of name (a typo),
// or "" when none is or two are equally near.
func nearestCommand(name string) string {
	best, bestD, tie := "", 3, false
	for _, c := range commands() {
		switch d := editDistance(name, c.name); {
		case d < bestD:
			best, bestD, tie = c.name, d, false
		case d == bestD:
			tie = true
		}
	}
	if tie {
		return ""
	}
	return best
}

// editDistance is the Levenshtein distance between a and b.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur := make([]int, len(b)+1)
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev = cur
	}
	return prev[len(b)]
}

func (e *env) usage(w io.Writer) {
	fmt.Fprintln(w, "usage: outbox <command> [flags]")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "commands:")
	for _, c := range commands() {
		fmt.Fprintf(w, "  %-8s %s\n", c.name, c.summary)
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Servers come from --database-url / --redis-url, or DATABASE_URL / REDIS_URL.")
	fmt.Fprintln(w, "Run 'outbox <command> -h' for a command's flags.")
}

func oneLine(err error) string {
	return strings.Join(strings.Fields(err.Error()), " ")
}

// common holds the flags every server-facing command takes.
type common struct {
	databaseURL string
	redisURL    string
	logFormat   string
	logLevel    string
	// redisCluster selects a Redis Cluster client (--redis-cluster, env
	// REDIS_CLUSTER); badClusterEnv is an REDIS_CLUSTER value that is not a
	// boolean, refused by logger with the other common flags.
	redisCluster  bool
	badClusterEnv string
}

// redis connects to the Redis of c: a cluster client with --redis-cluster.
func (c *common) redis(ctx context.Context, opt connect.RedisOptions) (redis.UniversalClient, error) {
	opt.Cluster = c.redisCluster
	return connect.RedisClient(ctx, c.redisURL, opt)
}

// isSet reports whether the command line gave flag name.
func isSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

// cmdName is the command being run: the deepest one known, else top.
func (e *env) cmdName(top string) string {
	if e.cmd != "" {
		return e.cmd
	}
	return top
}

func (e *env) flags(name string, c *common) *flag.FlagSet {
	e.cmd = name
	fs := flag.NewFlagSet("outbox "+name, flag.ContinueOnError)
	fs.SetOutput(e.stderr)
	if c != nil {
		fs.StringVar(&c.databaseURL, "database-url", envOr(e.getenv, "DATABASE_URL", defaultDatabaseURL), "PostgreSQL URL (env DATABASE_URL)")
		fs.StringVar(&c.redisURL, "redis-url", envOr(e.getenv, "REDIS_URL", defaultRedisURL), "Redis URL (env REDIS_URL)")
		cluster, err := strconv.ParseBool(envOr(e.getenv, "REDIS_CLUSTER", "false"))
		if err != nil {
			c.badClusterEnv = e.getenv("REDIS_CLUSTER")
		}
		fs.BoolVar(&c.redisCluster, "redis-cluster", cluster,
			"Redis is a Redis Cluster: --redis-url in the cluster form redis://host:port?addr=host2:port2&addr=... (env REDIS_CLUSTER=true)")
		fs.StringVar(&c.logFormat, "log-format", envOr(e.getenv, "OUTBOX_LOG_FORMAT", "text"), "log format: text or json (env OUTBOX_LOG_FORMAT)")
		fs.StringVar(&c.logLevel, "log-level", envOr(e.getenv, "OUTBOX_LOG_LEVEL", "info"), "log level: debug, info, warn or error (env OUTBOX_LOG_LEVEL)")
	}
	return fs
}

// parse parses args and rejects stray positional arguments.
func (e *env) parse(fs *flag.FlagSet, args []string) error {
	fs.SetOutput(io.Discard)
	err := fs.Parse(args)
	if errors.Is(err, flag.ErrHelp) {
		fs.SetOutput(e.stderr)
		fs.Usage()
		return err
	}
	if err != nil {
		return usageError{explainFlagError(fs, err)}
	}
	if fs.NArg() > 0 {
		return usagef("unexpected argument %q", fs.Arg(0))
	}
	return nil
}

// badFlagValue is the flag package's error for a value that does not parse.
var badFlagValue = regexp.MustCompile(`^invalid value "(.*)" for flag -([^:]+): (parse error|value out of range)$`)

// explainFlagError says what a flag of the kind fs has wants, where the
// flag package says only "parse error".
func explainFlagError(fs *flag.FlagSet, err error) string {
	m := badFlagValue.FindStringSubmatch(err.Error())
	if m == nil {
		return err.Error()
	}
	value, name := m[1], m[2]
	f := fs.Lookup(name)
	if f == nil {
		return err.Error()
	}
	var want string
	switch f.Value.(flag.Getter).Get().(type) {
	case time.Duration:
		want = "a duration with its unit, e.g. 5s, 500ms or 2m"
		if _, perr := strconv.ParseFloat(value, 64); perr == nil {
			want = "a duration needs its unit: " + value + "s, " + value + "ms, ..."
		}
	case int, int64, uint, uint64:
		want = "a whole number"
	case float64:
		want = "a number"
	case bool:
		want = "true or false"
	default:
		return err.Error()
	}
	if m[3] == "value out of range" {
		want = "a number in range"
	}
	return fmt.Sprintf("invalid value %q for --%s: %s", value, name, want)
}

func (c *common) logger(w io.Writer) (*slog.Logger, error) {
	if c.badClusterEnv != "" {
		return nil, usagef("REDIS_CLUSTER=%q: want true or false", c.badClusterEnv)
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(c.logLevel)); err != nil {
		return nil, usagef("--log-level %q: want debug, info, warn or error", c.logLevel)
	}
	opts := &slog.HandlerOptions{Level: level, ReplaceAttr: redactAttr}
	var log *slog.Logger
	switch c.logFormat {
	case "text":
		log = slog.New(slog.NewTextHandler(w, opts))
	case "json":
		log = slog.New(slog.NewJSONHandler(w, opts))
	default:
		return nil, usagef("--log-format %q: want text or json", c.logFormat)
	}
	connect.RedisLogs(log)
	return log, nil
}

func envOr(getenv func(string) string, key, def string) string {
	if v := getenv(key); v != "" {
		return v
	}
	return def
}

// redactAttr scrubs credentials from every log message, string and error
// (internal/connect.RedactSecrets): a driver's error may quote a connection
// string.
func redactAttr(_ []string, a slog.Attr) slog.Attr {
	switch v := a.Value; v.Kind() {
	case slog.KindString:
		if s := v.String(); s != "" {
			a.Value = slog.StringValue(connect.RedactSecrets(s))
		}
	case slog.KindAny:
		if err, ok := v.Any().(error); ok {
			a.Value = slog.StringValue(connect.RedactSecrets(err.Error()))
		}
	}
	return a
}
