package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/relaytest"
	"github.com/tedbank/outbox/internal/status"
)

func run(t *testing.T, vars map[string]string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	e := &env{stdout: &out, stderr: &errb, getenv: func(k string) string { return vars[k] }}
	code = e.main(context.Background(), args)
	return code, out.String(), errb.String()
}

func TestBadCommandLinesExitTwoWithOneLine(t *testing.T) {
	for _, args := range [][]string{
		{"nope"},
		{"relay", "--batch", "-5"},
		{"relay", "--lease", "0s"},
		{"relay", "--lease", "1s", "--publish-timeout", "2s"},
		{"relay", "--poll", "soon"},
		{"relay", "--backoff-base", "0s"},
		{"relay", "--backoff-base", "10s", "--backoff-max", "1s"},
		{"relay", "--stream-prefix", "a b"},
		{"fraud", "--max-deliveries", "0"},
		{"relay", "--min-replicas", "-1"},
		{"relay", "--min-replicas", "two"},
		{"relay", "--min-replicas", "1", "--replica-timeout", "10s"},
		{"fraud", "--min-replicas", "x"},
		{"fraud", "--retention", "5m"},
		{"settle"},
		{"settle", "--count", "10", "--accounts", "1"},
		{"settle", "--count", "10", "--rate", "-1"},
		{"status", "extra"},
		{"migrate", "--log-format", "xml"},
	} {
		code, stdout, stderr := run(t, nil, args...)
		if code != exitUsage || stdout != "" || strings.Count(strings.TrimSpace(stderr), "\n") != 0 || stderr == "" {
			t.Errorf("%v: exit %d, stdout %q, stderr %q; want exit 2 and one line on stderr", args, code, stdout, stderr)
		}
	}
}

// A typo of a command names the command meant; a flag value that does not
// parse says what the flag wants (the flag package says "parse error").
func TestUsageErrorsSayWhatTheyWant(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"rely"}, `unknown command "rely"; did you mean "relay"?`},
		{[]string{"stauts"}, `did you mean "status"?`},
		{[]string{"relay", "--lease", "5"}, `invalid value "5" for --lease: a duration needs its unit: 5s, 5ms`},
		{[]string{"relay", "--poll", "soon"}, `for --poll: a duration with its unit, e.g. 5s`},
		{[]string{"relay", "--batch", "x"}, `invalid value "x" for --batch: a whole number`},
		{[]string{"settle", "--count", "99999999999999999999"}, `for --count: a number in range`},
		{[]string{"relay", "--backoff-base", "10s", "--backoff-max", "1s"}, `--backoff-base 10s, --backoff-max 1s: the base must be positive and not above the max`},
	} {
		code, stdout, stderr := run(t, nil, c.args...)
		if code != exitUsage || stdout != "" || !strings.Contains(stderr, c.want) || strings.Contains(stderr, "parse error") {
			t.Errorf("%v: exit %d, stderr %q; want exit 2 and %q", c.args, code, stderr, c.want)
		}
	}
	if code, _, stderr := run(t, nil, "xyz"); code != exitUsage || strings.Contains(stderr, "did you mean") {
		t.Errorf("xyz: exit %d %q: no command is near it", code, stderr)
	}
}

// OUTBOX_MIN_REPLICAS is --min-replicas' default; a bad value is a usage
// error naming it.
func TestMinReplicasFromTheEnvironment(t *testing.T) {
	for _, cmd := range []string{"relay", "fraud"} {
		code, _, stderr := run(t, map[string]string{"OUTBOX_MIN_REPLICAS": "many"}, cmd)
		if code != exitUsage || !strings.Contains(stderr, "OUTBOX_MIN_REPLICAS") {
			t.Errorf("%s with OUTBOX_MIN_REPLICAS=many: exit %d, stderr %q", cmd, code, stderr)
		}
	}
}

// OUTBOX_PARTITIONS and REDIS_CLUSTER are the defaults of --partitions and
// --redis-cluster; a value that is not one is a usage error naming it, and
// anti-fraud's rule (a cluster needs two partitions or more) holds for the
// demo and reconcile too.
func TestPartitionsAndClusterFromTheEnvironment(t *testing.T) {
	for _, c := range []struct {
		env  map[string]string
		args []string
		want string
	}{
		{map[string]string{"OUTBOX_PARTITIONS": "0"}, []string{"relay"}, "OUTBOX_PARTITIONS"},
		{map[string]string{"OUTBOX_PARTITIONS": "many"}, []string{"fraud"}, "OUTBOX_PARTITIONS"},
		{nil, []string{"status", "--partitions", "1025"}, "--partitions"},
		{map[string]string{"REDIS_CLUSTER": "maybe"}, []string{"status"}, "REDIS_CLUSTER"},
		{map[string]string{"REDIS_CLUSTER": "true"}, []string{"reconcile", "--partitions", "1"}, "partitions"},
		{nil, []string{"demo", "--redis-cluster", "--partitions", "1"}, "--partitions 1"},
		{map[string]string{"OUTBOX_PARTITIONS": "2000"}, []string{"reconcile"}, "OUTBOX_PARTITIONS"},
	} {
		code, stdout, stderr := run(t, c.env, c.args...)
		if code != exitUsage || stdout != "" || !strings.Contains(stderr, c.want) {
			t.Errorf("%v %v: exit %d, stderr %q; want exit 2 naming %s", c.env, c.args, code, stderr, c.want)
		}
	}
}

func TestUnreachableServerIsOneClearLine(t *testing.T) {
	env := map[string]string{
		"DATABASE_URL": "postgres://app:s3cret-pw@127.0.0.1:1/db?sslmode=disable&connect_timeout=2",
		"REDIS_URL":    "redis://:r3dis-pw@127.0.0.1:1/0",
	}
	for _, args := range [][]string{{"migrate"}, {"relay", "--wait-for-servers", "0"}, {"status"}, {"settle", "--count", "1"},
		{"fraud", "--wait-for-servers", "0"}} {
		code, _, stderr := run(t, env, args...)
		if code != exitFailure || strings.Count(strings.TrimSpace(stderr), "\n") != 0 || !strings.Contains(stderr, "cannot reach") {
			t.Errorf("%v: exit %d, stderr %q; want exit 1 and one 'cannot reach' line", args, code, stderr)
		}
		if strings.Contains(stderr, "s3cret-pw") || strings.Contains(stderr, "r3dis-pw") {
			t.Errorf("%v: password leaked: %s", args, stderr)
		}
	}
}

func TestMissingSchemaSaysRunMigrate(t *testing.T) {
	url := outboxtest.PostgresURL(t)
	rdb := outboxtest.NewRedis(t)
	code, _, stderr := run(t, map[string]string{"DATABASE_URL": url, "REDIS_URL": rdb.URL}, "status", "--stream", rdb.Prefix+"s")
	if code != exitOK {
		t.Fatalf("status on a migrated database: exit %d %s", code, stderr)
	}
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(context.Background(), "DROP TABLE outbox_messages"); err != nil {
		t.Fatal(err)
	}
	code, _, stderr = run(t, map[string]string{"DATABASE_URL": url, "REDIS_URL": rdb.URL}, "relay")
	if code != exitFailure || !strings.Contains(stderr, "outbox migrate") {
		t.Fatalf("relay without schema: exit %d, %q", code, stderr)
	}
	// status says what is so: the server answered, the tables are missing.
	code, stdout, _ := run(t, map[string]string{"DATABASE_URL": url, "REDIS_URL": rdb.URL}, "status", "--stream", rdb.Prefix+"s")
	if code != exitFailure || !strings.Contains(stdout, "PostgreSQL not migrated: ") || strings.Contains(stdout, "unreachable") {
		t.Fatalf("status without schema: exit %d, %q; want it not migrated, not unreachable", code, stdout)
	}
}

func TestSettleAndStatusJSON(t *testing.T) {
	url := outboxtest.PostgresURL(t)
	rdb := outboxtest.NewRedis(t)
	env := map[string]string{"DATABASE_URL": url, "REDIS_URL": rdb.URL}
	code, stdout, stderr := run(t, env, "settle", "--count", "50", "--concurrency", "4", "--accounts", "5", "--json")
	if code != exitOK {
		t.Fatalf("settle: exit %d %s", code, stderr)
	}
	var sum SettleSummary
	if err := json.Unmarshal([]byte(stdout), &sum); err != nil || sum.Settled != 50 || sum.Failed != 0 {
		t.Fatalf("settle summary %s (err %v)", stdout, err)
	}
	// No relay runs: the 50 wait, and status says so with exit 1.
	code, stdout, stderr = run(t, env, "status", "--json", "--stream", rdb.Prefix+"outbox.event.transfer")
	if code != exitFailure || !strings.Contains(stderr, "no live relay while 50 events wait") {
		t.Fatalf("status: exit %d %s", code, stderr)
	}
	var st map[string]any
	if err := json.Unmarshal([]byte(stdout), &st); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"pending", "publishing", "published", "dead", "oldest_pending_seconds", "stream_length", "group_pending",
		"healthy", "problems", "retrying", "live_relays", "relays", "relay_partitions", "retrying_events", "dead_events", "members", "live_members"} {
		if _, ok := st[k]; !ok {
			t.Errorf("status lacks %q: %s", k, stdout)
		}
	}
	if st["pending"] != float64(50) || st["oldest_pending_seconds"].(float64) <= 0 {
		t.Fatalf("status %s: want 50 pending with an age", stdout)
	}
}

// A credential in a server URL never reaches the output, whether the URL
// parses or not (a bad port makes the parser quote it back).
func TestBadServerURLsDoNotLeakPasswords(t *testing.T) {
	const secret = "topsecret-4711"
	for _, c := range []struct {
		vars map[string]string
		args []string
	}{
		{map[string]string{"REDIS_URL": "redis://:" + secret + "@127.0.0.1:abc/15"}, []string{"fraud", "report"}},
		{map[string]string{"REDIS_URL": "redis://default:" + secret + "@127.0.0.1:1/0"}, []string{"fraud", "report"}},
		{map[string]string{"DATABASE_URL": "postgres://u:" + secret + "@127.0.0.1:abc/db"}, []string{"status"}},
		{map[string]string{"DATABASE_URL": "host=127.0.0.1 port=abc user=u password=" + secret}, []string{"status"}},
		{map[string]string{"DATABASE_URL": "host=127.0.0.1 port=1 user=u password='" + secret + "'"}, []string{"status"}},
		{nil, []string{"relay", "--database-url", "postgres://u:" + secret + "@127.0.0.1:1/db", "--log-level", "debug", "--wait-for-servers", "300ms"}},
	} {
		code, stdout, stderr := run(t, c.vars, c.args...)
		if code == 0 || stderr == "" {
			t.Errorf("%v %v: exit %d, stderr %q: want a failure explained on stderr", c.vars, c.args, code, stderr)
		}
		if strings.Contains(stdout+stderr, secret) {
			t.Errorf("%v %v leaks the password:\n%s%s", c.vars, c.args, stdout, stderr)
		}
	}
}

// During an outage, status shows what the reachable side says, marks the
// other unreachable and exits 1.
func TestStatusShowsTheReachableSideDuringAnOutage(t *testing.T) {
	url := outboxtest.PostgresURL(t)
	rdb := outboxtest.NewRedis(t)
	stream := rdb.Prefix + "outbox.event.transfer"
	up := map[string]string{"DATABASE_URL": url, "REDIS_URL": rdb.URL}
	if code, _, stderr := run(t, up, "settle", "--count", "3", "--json"); code != exitOK {
		t.Fatalf("settle: exit %d %s", code, stderr)
	}
	if err := rdb.XAdd(context.Background(), &redis.XAddArgs{Stream: stream, Values: []any{"k", "v"}}).Err(); err != nil {
		t.Fatal(err)
	}
	const down = "127.0.0.1:1" // nothing listens there

	redisDown := map[string]string{"DATABASE_URL": url, "REDIS_URL": "redis://" + down + "/0"}
	code, stdout, _ := run(t, redisDown, "status", "--json", "--stream", stream)
	var st status.Status
	if err := json.Unmarshal([]byte(stdout), &st); err != nil || code != exitFailure || st.Pending != 3 || st.RedisError == "" || st.PostgresError != "" {
		t.Errorf("Redis down: exit %d, %s (err %v); want exit 1, the 3 pending rows and redis_error", code, stdout, err)
	}
	code, stdout, _ = run(t, redisDown, "status", "--stream", stream)
	if code != exitFailure || !strings.Contains(stdout, "pending 3") || !strings.Contains(stdout, "Redis unreachable") {
		t.Errorf("Redis down, text: exit %d\n%s", code, stdout)
	}

	pgDown := map[string]string{"DATABASE_URL": "postgres://postgres@" + down + "/x?connect_timeout=2", "REDIS_URL": rdb.URL}
	code, stdout, _ = run(t, pgDown, "status", "--json", "--stream", stream)
	st = status.Status{}
	if err := json.Unmarshal([]byte(stdout), &st); err != nil || code != exitFailure || st.StreamLength != 1 || st.PostgresError == "" || st.RedisError != "" {
		t.Errorf("PostgreSQL down: exit %d, %s (err %v); want exit 1, the stream's length 1 and postgres_error", code, stdout, err)
	}
	code, stdout, _ = run(t, pgDown, "status", "--stream", stream)
	if code != exitFailure || !strings.Contains(stdout, "PostgreSQL unreachable") || !strings.Contains(stdout, "length 1") {
		t.Errorf("PostgreSQL down, text: exit %d\n%s", code, stdout)
	}

	if code, _, stderr := run(t, up, "status", "--stream", "bad stream"); code != exitUsage || !strings.Contains(stderr, "bad stream") {
		t.Errorf("status --stream 'bad stream': exit %d %q, want a usage error", code, stderr)
	}
}

// The rough edges an adopter met, each answered where it belongs.
func TestCommandLineRoughEdges(t *testing.T) {
	url := outboxtest.PostgresURL(t)
	rdb := outboxtest.NewRedis(t)
	env := map[string]string{"DATABASE_URL": url, "REDIS_URL": rdb.URL}
	for _, c := range []struct {
		vars        map[string]string
		args        []string
		code        int
		want, avoid string
	}{
		{nil, []string{"bench", "-h"}, exitOK, "writers|latency|drain|consume|sustained", "see 'outbox bench -h'"},
		{nil, []string{"fraud", "-h"}, exitOK, "outbox fraud dlq <list|retry>", ""},
		{nil, []string{"fraud", "dlq", "bogus"}, exitUsage, "(see 'outbox fraud dlq -h')", ""},
		{env, []string{"dead", "retry"}, exitUsage, "(see 'outbox dead retry -h')", ""},
		{env, []string{"fraud", "dlq", "retry"}, exitUsage, "(see 'outbox fraud dlq retry -h')", ""},
		{env, []string{"cleanup", "--older-than", "0s"}, exitUsage, "must be positive", "required"},
		{env, []string{"settle"}, exitUsage, "--count is required", "must be positive"},
	} {
		if c.vars == nil {
			c.vars = env
		}
		code, stdout, stderr := run(t, c.vars, c.args...)
		out := stdout + stderr
		if code != c.code || !strings.Contains(out, c.want) || (c.avoid != "" && strings.Contains(out, c.avoid)) {
			t.Errorf("%v: exit %d (want %d), output %q: want %q, not %q", c.args, code, c.code, out, c.want, c.avoid)
		}
	}

	// A database index the server does not have is not an unreachable server.
	u := rdb.URL[:strings.LastIndex(rdb.URL, "/")] + "/99"
	code, _, stderr := run(t, map[string]string{"REDIS_URL": u}, "fraud", "report")
	if code != exitFailure || strings.Contains(stderr, "is it running") || !strings.Contains(stderr, "databases") {
		t.Errorf("db index 99: exit %d %q", code, stderr)
	}

	// Tracing: an unknown exporter names the variable; console spans stay
	// out of --json output.
	t.Setenv("OTEL_TRACES_EXPORTER", "zipkin2")
	if code, _, stderr := run(t, env, "settle", "--count", "1"); code == exitOK || !strings.Contains(stderr, "OTEL_TRACES_EXPORTER") {
		t.Errorf("unknown exporter: exit %d %q", code, stderr)
	}
	t.Setenv("OTEL_TRACES_EXPORTER", "console")
	if code, _, stderr := run(t, env, "migrate"); code != exitOK {
		t.Fatalf("migrate: %d %s", code, stderr)
	}
	// The real binary: the exporter writes to the process's own streams.
	cmd := exec.Command(outboxtest.Binary(t), "settle", "--count", "2", "--json")
	cmd.Env = append(os.Environ(), "DATABASE_URL="+url, "REDIS_URL="+rdb.URL, "OTEL_TRACES_EXPORTER=console")
	var outb, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &outb, &errb
	err := cmd.Run()
	stdout, stderr := outb.String(), errb.String()
	var sum SettleSummary
	if err != nil || json.Unmarshal([]byte(stdout), &sum) != nil || sum.Settled != 2 || strings.Count(stdout, "\n") != 1 || !strings.Contains(stderr, "transfer.settle") {
		t.Errorf("console exporter: %v, stdout %q (want only the JSON summary; spans on stderr) stderr %q", err, stdout, stderr)
	}
}

func TestSettleProgressLine(t *testing.T) {
	if got := progressLine(2500, 100000, 25*time.Second); got != "2500/100000 TEDs (2%), 100/s, ETA 16m15s" {
		t.Errorf("got %q", got)
	}
	if got := progressLine(10, 10, time.Second); got != "10/10 TEDs (100%), 10/s" {
		t.Errorf("done: got %q", got)
	}
	if isTerminal(&bytes.Buffer{}) {
		t.Error("a buffer is not a terminal")
	}

	// Stopped, the progress line is erased before stop returns, and
	// nothing follows: the summary printed next starts a clean line.
	var w relaytest.SyncBuffer
	lines := make(chan struct{}, 100)
	stop := startProgress(&w, time.Millisecond, func() string { lines <- struct{}{}; return "42/100 TEDs" })
	<-lines
	<-lines
	stop()
	got := string(w.Bytes())
	stop() // again: nothing
	if !strings.HasSuffix(got, "42/100 TEDs\r\033[K") || string(w.Bytes()) != got {
		t.Errorf("progress output %q then %q: want the last line erased at stop, nothing after", got, w.Bytes())
	}
}

// settle --plain-sql writes its share of the TEDs as a plain SQL writer
// would (no partition_key): migration 0015 keys each by its sender, and the
// payload is a valid transfer.settled whose event_id is the row's id.
func TestSettlePlainSQL(t *testing.T) {
	url := outboxtest.PostgresURL(t)
	env := map[string]string{"DATABASE_URL": url}
	if code, _, stderr := run(t, env, "settle", "--count", "20", "--plain-sql", "1", "--accounts", "5"); code != exitOK {
		t.Fatalf("settle --plain-sql 1: exit %d %s", code, stderr)
	}
	if code, _, stderr := run(t, env, "settle", "--count", "1", "--plain-sql", "1.5"); code != exitUsage || !strings.Contains(stderr, "--plain-sql") {
		t.Fatalf("settle --plain-sql 1.5: exit %d %s, want a usage error", code, stderr)
	}
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var n, keyed, valid int
	if err := conn.QueryRow(context.Background(), `SELECT count(*),
			count(*) FILTER (WHERE partition_key = payload->>'from_account'),
			count(*) FILTER (WHERE payload->>'event_id' = id::text AND payload->>'transfer_id' = aggregate_id)
		FROM outbox_messages`).Scan(&n, &keyed, &valid); err != nil {
		t.Fatal(err)
	}
	if n != 20 || keyed != 20 || valid != 20 {
		t.Fatalf("%d events, %d keyed by their sender, %d with their own ids in the payload; want 20 each", n, keyed, valid)
	}
}

// With DATABASE_URL and REDIS_URL, the demo leaves nothing behind: its
// tables and rows go into a database of its own on that server, dropped at
// the end, and its Redis keys under a prefix of its own are removed (issue
// 40: it left its tables and 808 rows in the user's database).
func TestDemoOnSomeoneElsesServersLeavesNothingBehind(t *testing.T) {
	t.Parallel()
	url := outboxtest.PostgresURL(t)
	rdb := outboxtest.NewRedis(t)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	cmd := exec.Command(outboxtest.Binary(t), "demo", "--short")
	cmd.Env = append(os.Environ(), "DATABASE_URL="+url, "REDIS_URL="+rdb.URL, "NO_COLOR=1")
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "checks passed, 0 failed") ||
		!strings.Contains(string(out), "the demo's tables go into a database of its own there") {
		t.Fatalf("demo: %v\n%s", err, out)
	}
	var rows int
	if err := pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM outbox_messages) + (SELECT count(*) FROM transfers)").Scan(&rows); err != nil || rows != 0 {
		t.Errorf("the user's database has %d outbox and transfer rows after the demo (%v), want 0", rows, err)
	}
	var leftover []string
	r, err := pool.Query(ctx, "SELECT datname FROM pg_database WHERE datname LIKE 'outbox_demo%'")
	if err != nil {
		t.Fatal(err)
	}
	for r.Next() {
		var name string
		if err := r.Scan(&name); err != nil {
			t.Fatal(err)
		}
		leftover = append(leftover, name)
	}
	if len(leftover) > 0 {
		t.Errorf("databases %v left on the server after the demo", leftover)
	}
	if n, err := rdb.Keys(ctx, "demo-*").Result(); err != nil || len(n) > 0 {
		t.Errorf("demo keys left in Redis: %v (%v)", n, err)
	}
}
