package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/status"
)

// deployment is a migrated database and a Redis key prefix of a test's own,
// with the flags that point the commands at them.
type deployment struct {
	t    *testing.T
	env  map[string]string
	pool *pgxpool.Pool
	rdb  outboxtest.Redis
}

func newDeployment(t *testing.T) *deployment {
	url := outboxtest.PostgresURL(t)
	rdb := outboxtest.NewRedis(t)
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return &deployment{t: t, env: map[string]string{"DATABASE_URL": url, "REDIS_URL": rdb.URL}, pool: pool, rdb: rdb}
}

func (d *deployment) stream() string    { return d.rdb.Prefix + "outbox.event.transfer" }
func (d *deployment) keyPrefix() string { return d.rdb.Prefix + "fraud:" }

// start runs a long-running command (relay, fraud) in this process until
// the test ends, and stops it as SIGTERM would, expecting exit 0.
func (d *deployment) start(args ...string) {
	d.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	var out bytes.Buffer
	e := &env{stdout: &out, stderr: &out, getenv: func(k string) string { return d.env[k] }}
	go func() { done <- e.main(ctx, args) }()
	d.t.Cleanup(func() {
		cancel()
		if code := <-done; code != exitOK {
			d.t.Errorf("%v: exit %d\n%s", args, code, out.String())
		}
	})
}

// startRelay starts relay name and waits until it lives.
func (d *deployment) startRelay(name string, args ...string) {
	d.t.Helper()
	d.start(append([]string{"relay", "--stream-prefix", d.rdb.Prefix + "outbox.event.", "--name", name}, args...)...)
	outboxtest.Eventually(d.t, 10*time.Second, func() bool {
		var n int
		_ = d.pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox_relay_members m
		    JOIN outbox_live_relays l ON l.pid = m.pid WHERE m.owner = $1`, name).Scan(&n)
		return n == 1
	}, "relay %s did not start", name)
}

// status runs 'outbox status --json' with args and returns its exit code
// and what it printed.
func (d *deployment) status(args ...string) (int, status.Status) {
	d.t.Helper()
	code, stdout, stderr := run(d.t, d.env, append([]string{"status", "--json"}, args...)...)
	var st status.Status
	if err := json.Unmarshal([]byte(stdout), &st); err != nil {
		d.t.Fatalf("status %v: exit %d, %q %q: %v", args, code, stdout, stderr, err)
	}
	return code, st
}

func (d *deployment) exec(sql string, args ...any) {
	d.t.Helper()
	if _, err := d.pool.Exec(context.Background(), sql, args...); err != nil {
		d.t.Fatalf("%s: %v", sql, err)
	}
}

func hasProblem(st status.Status, part string) bool {
	for _, p := range st.Problems {
		if strings.Contains(p, part) {
			return true
		}
	}
	return false
}

// A deployment that delivers: status exits 0, says so, and shows the live
// relay and consumer.
func TestStatusHealthyDeploymentExitsZero(t *testing.T) {
	t.Parallel()
	d := newDeployment(t)
	d.startRelay("r1")
	d.start("fraud", "--stream", d.stream(), "--key-prefix", d.keyPrefix(), "--consumer", "c1")
	if code, _, stderr := run(t, d.env, "settle", "--count", "20", "--json"); code != exitOK {
		t.Fatalf("settle: exit %d %s", code, stderr)
	}
	var st status.Status
	var code int
	outboxtest.Eventually(t, 20*time.Second, func() bool {
		code, st = d.status("--stream", d.stream(), "--key-prefix", d.keyPrefix())
		return st.Published == 20 && st.GroupLag == 0 && st.GroupPending == 0 && st.LiveMembers == 1
	}, "not every TED delivered: %+v", func() any { return st })
	if code != exitOK || !st.Healthy || len(st.Problems) != 0 || st.LiveRelays != 1 || len(st.Relays) != 1 ||
		!st.Relays[0].Alive || st.Relays[0].Name != "r1" || st.ByPartition[0].Owner != "c1" || !st.ByPartition[0].OwnerAlive {
		t.Fatalf("a healthy deployment: exit %d, %+v", code, st)
	}
	code, stdout, _ := run(t, d.env, "status", "--stream", d.stream(), "--key-prefix", d.keyPrefix())
	if code != exitOK || !strings.Contains(stdout, "delivering: no problem found") || !strings.Contains(stdout, "members  live 1: c1") {
		t.Fatalf("text: exit %d\n%s", code, stdout)
	}
}

// Events wait and no relay lives: exit 1, with the problem on stdout and
// in one line on stderr.
func TestStatusNoLiveRelayWhileEventsWait(t *testing.T) {
	t.Parallel()
	d := newDeployment(t)
	if code, _ := d.status("--stream", d.stream(), "--key-prefix", d.keyPrefix()); code != exitOK {
		t.Fatalf("an empty deployment: exit %d, want 0 (nothing waits)", code)
	}
	if code, _, stderr := run(t, d.env, "settle", "--count", "3", "--json"); code != exitOK {
		t.Fatalf("settle: exit %d %s", code, stderr)
	}
	code, st := d.status("--stream", d.stream(), "--key-prefix", d.keyPrefix())
	if code != exitFailure || st.Healthy || !hasProblem(st, "no live relay while 3 events wait") {
		t.Fatalf("exit %d, %+v; want exit 1 and the problem", code, st.Problems)
	}
	code, stdout, stderr := run(t, d.env, "status", "--stream", d.stream(), "--key-prefix", d.keyPrefix())
	if code != exitFailure || !strings.Contains(stdout, "NOT DELIVERED: 1 problem\n") ||
		!strings.Contains(stderr, "not delivered: no live relay while 3 events wait") || strings.Count(stderr, "\n") != 1 {
		t.Fatalf("text: exit %d\n%s\nstderr %q", code, stdout, stderr)
	}
}

// deadBackend returns the pid of a PostgreSQL backend that has exited, as a
// SIGKILLed relay's LISTEN backend has.
func (d *deployment) deadBackend() int {
	d.t.Helper()
	conn, err := d.pool.Acquire(context.Background())
	if err != nil {
		d.t.Fatal(err)
	}
	var pid int
	if err := conn.QueryRow(context.Background(), "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		d.t.Fatal(err)
	}
	raw := conn.Hijack()
	if err := raw.Close(context.Background()); err != nil {
		d.t.Fatal(err)
	}
	outboxtest.Eventually(d.t, 10*time.Second, func() bool {
		var n int
		_ = d.pool.QueryRow(context.Background(), "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid).Scan(&n)
		return n == 0
	}, "backend %d did not exit", pid)
	return pid
}

// Relays killed leave their memberships, slot leases and claims behind
// with the pid of a backend that is gone: what both relays SIGKILLed leave
// (the real kill is TestStatusAfterRelaysAreKilled at the top level).
func TestStatusDeadRelaysHoldingSlotsAndClaims(t *testing.T) {
	t.Parallel()
	d := newDeployment(t)
	if code, _, stderr := run(t, d.env, "settle", "--count", "4", "--json"); code != exitOK {
		t.Fatalf("settle: exit %d %s", code, stderr)
	}
	pid := d.deadBackend()
	d.exec(`INSERT INTO outbox_relay_members (owner, seen_until, pid) VALUES ('r1', now() + interval '30 seconds', $1), ('r2', 'infinity', $1)`, pid)
	d.exec(`UPDATE outbox_relay_partitions SET owner = 'r1', owner_pid = $1, token = gen_random_uuid(), lease_until = now() + interval '30 seconds' WHERE slot < 8`, pid)
	d.exec(`UPDATE outbox_messages SET status = 'publishing', claimed_at = now(), claimed_by = 'r2', claim_token = gen_random_uuid(), claimed_pid = $1
	         WHERE seq IN (SELECT seq FROM outbox_messages ORDER BY seq LIMIT 2)`, pid)

	code, st := d.status("--stream", d.stream(), "--key-prefix", d.keyPrefix())
	for _, want := range []string{
		"no live relay while 4 events wait",
		"relay r1 is dead and holds 8 partition slots",
		"relay r2 is dead and holds 2 claimed events",
	} {
		if !hasProblem(st, want) {
			t.Errorf("problems %q lack %q", st.Problems, want)
		}
	}
	if code != exitFailure || st.LiveRelays != 0 || len(st.Relays) != 2 || st.Relays[0].Alive || st.Relays[0].Slots != 8 ||
		st.Relays[1].Claimed != 2 || st.RelaySlots["r1"] != 8 || st.RelaySlotsFree != 8 || len(st.RelayPartitions) != 16 {
		t.Fatalf("exit %d, %+v", code, st)
	}

	// Nothing waits, and the dead relays are still there: no relay lives
	// to deliver the next event, nor to bury them.
	d.exec(`UPDATE outbox_messages SET status = 'published', published_at = now(), claimed_at = NULL, claimed_by = NULL, claim_token = NULL`)
	d.exec(`UPDATE outbox_relay_partitions SET owner = NULL, owner_pid = NULL, token = NULL, lease_until = '-infinity'`)
	code, st = d.status("--stream", d.stream(), "--key-prefix", d.keyPrefix())
	if code != exitFailure || !hasProblem(st, "no live relay: r1, r2 died and none took over") || len(st.Problems) != 1 {
		t.Fatalf("dead relays, nothing waiting: exit %d, %q", code, st.Problems)
	}

	// A live relay: healthy again at once (the dead ones hold nothing),
	// and it buries them (its watch, a fraction of a second).
	d.startRelay("r3")
	code, st = d.status("--stream", d.stream(), "--key-prefix", d.keyPrefix())
	if code != exitOK || st.LiveRelays != 1 {
		t.Fatalf("with r3 alive: exit %d, %q", code, st.Problems)
	}
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		code, st = d.status("--stream", d.stream(), "--key-prefix", d.keyPrefix())
		return code == exitOK && len(st.Relays) == 1 && st.Relays[0].Name == "r3" && st.Relays[0].Alive
	}, "r3 did not bury r1 and r2: exit %d, relays %+v", func() any { return code }, func() any { return st.Relays })
}

// Retrying rows are shown with their attempts, last error and next try;
// dead rows with theirs; neither alone makes the outbox undelivered.
func TestStatusShowsRetryingAndDeadRows(t *testing.T) {
	t.Parallel()
	d := newDeployment(t)
	d.startRelay("r1", "--poll", "1h")
	d.exec(`INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, status, attempts, last_error, next_attempt_at)
	        VALUES ('order', 'o-1', 'order.placed', '{}', 'pending', 3, 'WRONGTYPE Operation against a key holding the wrong kind of value', now() + interval '1 hour'),
	               ('order', 'o-2', 'order.placed', '{}', 'dead', 10, 'payload too large for the broker', now())`)
	code, st := d.status("--stream", d.stream(), "--key-prefix", d.keyPrefix())
	if code != exitOK || st.Retrying != 1 || st.Dead != 1 || len(st.RetryingEvents) != 1 || len(st.DeadEvents) != 1 {
		t.Fatalf("exit %d, %+v", code, st)
	}
	r := st.RetryingEvents[0]
	if r.Attempts != 3 || !strings.HasPrefix(r.LastError, "WRONGTYPE") || r.NextAttemptInSeconds < 3500 || r.AggregateID != "o-1" {
		t.Fatalf("retrying event %+v", r)
	}
	if dead := st.DeadEvents[0]; dead.Attempts != 10 || dead.LastError != "payload too large for the broker" {
		t.Fatalf("dead event %+v", dead)
	}
	// The console's light read (the partial indexes only) has the same
	// figures but the published rows, which it does not count.
	d.exec(`INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, status, published_at)
	        VALUES ('order', 'o-3', 'order.placed', '{}', 'published', now())`)
	light, err := status.Read(context.Background(), status.Options{Stream: d.stream(), Group: "fraud", KeyPrefix: d.keyPrefix(), Light: true, Samples: 5},
		status.Servers{Postgres: d.pool, Redis: d.rdb.Client})
	if err != nil || light.PublishedCounted || light.Published != 0 || light.Pending != 1 || light.Retrying != 1 || light.Dead != 1 ||
		len(light.RetryingEvents) != 1 || len(light.RelayPartitions) != 16 {
		t.Fatalf("light read: %+v (err %v)", light, err)
	}
	if light.RelayPartitionsCappedAt != 0 {
		t.Errorf("light read of 1 unpublished row: slots capped at %d, want 0 (every row counted)", light.RelayPartitionsCappedAt)
	}
	// The slots' backlogs stop at LightSlotRows rows, and say so.
	capped, err := status.Read(context.Background(), status.Options{Stream: d.stream(), Group: "fraud", KeyPrefix: d.keyPrefix(), Light: true, LightSlotRows: 1},
		status.Servers{Postgres: d.pool, Redis: d.rdb.Client})
	if err != nil || capped.RelayPartitionsCappedAt != 1 {
		t.Fatalf("light read counting 1 row of 1 unpublished: slots capped at %d, want 1 (err %v)", capped.RelayPartitionsCappedAt, err)
	}
	capped.RelaySlots = map[string]int{"r1": 16} // printed with slots held only
	var text strings.Builder
	printStatus(&text, capped)
	if want := "(waiting: among the oldest 1 unpublished rows only, and there may be more"; !strings.Contains(text.String(), want) {
		t.Errorf("text lacks %q:\n%s", want, text.String())
	}
	if code, st = d.status("--stream", d.stream(), "--key-prefix", d.keyPrefix()); !st.PublishedCounted || st.Published != 1 || st.RelayPartitionsCappedAt != 0 {
		t.Fatalf("status counts the published rows: exit %d, %+v", code, st)
	}
	code, stdout, _ := run(t, d.env, "status", "--stream", d.stream(), "--key-prefix", d.keyPrefix())
	for _, want := range []string{"retrying 1", "attempts 3  next try in 3", ": WRONGTYPE Operation", "dead     ", "attempts 10: payload too large"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("text lacks %q:\n%s", want, stdout)
		}
	}
	if code != exitOK {
		t.Errorf("exit %d, want 0", code)
	}
}

// The consumer side: a group with entries waiting and no live member, a
// partition held by a dead consumer, a stream with entries and no group.
func TestStatusConsumerGroupProblems(t *testing.T) {
	t.Parallel()
	d := newDeployment(t)
	ctx := context.Background()
	args := []string{"--stream", d.stream(), "--key-prefix", d.keyPrefix()}
	for range 3 {
		if err := d.rdb.XAdd(ctx, &redis.XAddArgs{Stream: d.stream(), Values: []any{"k", "v"}}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	code, st := d.status(args...)
	if code != exitFailure || !hasProblem(st, "group fraud does not exist on "+d.stream()+": nothing has read its 3 entries") {
		t.Fatalf("no group: exit %d, %q", code, st.Problems)
	}
	if err := d.rdb.XGroupCreate(ctx, d.stream(), "fraud", "0").Err(); err != nil {
		t.Fatal(err)
	}
	code, st = d.status(args...)
	if code != exitFailure || !hasProblem(st, "group fraud has no live consumer while 3 entries wait (lag 3, pending 0)") || len(st.Problems) != 1 {
		t.Fatalf("no member: exit %d, %q", code, st.Problems)
	}

	// c9 holds the partition's lease and its membership runs, but its
	// presence connection is gone: it was killed.
	if err := d.rdb.Set(ctx, d.keyPrefix()+"lease:fraud", "7|c9|p-0123456789abcdef", 10*time.Second).Err(); err != nil {
		t.Fatal(err)
	}
	if err := d.rdb.ZAdd(ctx, d.keyPrefix()+"members:fraud", redis.Z{Member: "c9", Score: float64(time.Now().Add(time.Minute).UnixMilli())}).Err(); err != nil {
		t.Fatal(err)
	}
	if err := d.rdb.Set(ctx, d.keyPrefix()+"consumer:fraud:c9", "p-0123456789abcdef", time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	code, st = d.status(args...)
	if code != exitFailure || !hasProblem(st, "partition 0 of group fraud is held by c9, which is dead") ||
		!hasProblem(st, "no live consumer while 3 entries wait") || len(st.Members) != 1 || st.Members[0].Alive {
		t.Fatalf("dead owner: exit %d, %q %+v", code, st.Problems, st.Members)
	}

	// The same process with its presence connection open is alive.
	conn := d.rdb.Conn()
	defer conn.Close()
	if err := conn.ClientSetName(ctx, "outbox-consumer-p-0123456789abcdef").Err(); err != nil {
		t.Fatal(err)
	}
	code, st = d.status(args...)
	if code != exitOK || st.LiveMembers != 1 || !st.ByPartition[0].OwnerAlive || st.ByPartition[0].LeaseSecondsLeft <= 0 {
		t.Fatalf("live owner: exit %d, %q %+v", code, st.Problems, st.ByPartition)
	}
}

// An event type of one's own is named once: --aggregate picks its stream and
// its rows, --group its consumers' keys.
func TestStatusOfAnAggregateAndGroupOfOnesOwn(t *testing.T) {
	t.Parallel()
	d := newDeployment(t)
	if code, _, stderr := run(t, d.env, "settle", "--count", "2", "--json"); code != exitOK {
		t.Fatalf("settle: exit %d %s", code, stderr)
	}
	d.exec(`INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload)
	        VALUES ('order', 'o-1', 'order.placed', '{}')`)
	group := d.rdb.Prefix + "billing" // its key prefix, <group>:, is the test's own
	code, st := d.status("--aggregate", "order", "--group", group, "--stream-prefix", d.rdb.Prefix+"outbox.event.")
	if code != exitFailure || st.Aggregate != "order" || st.Pending != 1 || st.Stream != d.rdb.Prefix+"outbox.event.order" ||
		st.KeyPrefix != group+":" || st.DeadLetterStream != group+":dlq" || st.Group != group {
		t.Fatalf("exit %d, %+v", code, st)
	}
	if !hasProblem(st, "no live relay while 1 event waits") {
		t.Fatalf("problems %q", st.Problems)
	}
	for _, args := range [][]string{{"--aggregate", "bad type"}, {"--samples", "-1"}} {
		if code, _, stderr := run(t, d.env, append([]string{"status"}, args...)...); code != exitUsage || !strings.Contains(stderr, args[0]) {
			t.Errorf("status %v: exit %d %q, want a usage error naming it", args, code, stderr)
		}
	}
}

// A partition owner whose LISTEN connection is down renews its membership
// and leases without a pid: it is alive while they run, as the relays count
// each other, not dead.
func TestStatusRelayWithoutAPidIsAliveWhileItsMembershipRuns(t *testing.T) {
	t.Parallel()
	d := newDeployment(t)
	d.exec(`INSERT INTO outbox_relay_members (owner, seen_until, pid) VALUES ('r9', now() + interval '30 seconds', NULL)`)
	d.exec(`UPDATE outbox_relay_partitions SET owner = 'r9', owner_pid = NULL, token = gen_random_uuid(), lease_until = now() + interval '30 seconds'`)
	code, st := d.status("--stream", d.stream(), "--key-prefix", d.keyPrefix())
	if code != exitOK || st.LiveRelays != 1 || len(st.Relays) != 1 || !st.Relays[0].Alive || st.RelaySlots["r9"] != 16 || !st.RelayPartitions[0].Alive {
		t.Fatalf("exit %d, problems %q, relays %+v, slot 0 %+v", code, st.Problems, st.Relays, st.RelayPartitions[0])
	}
	// Its membership ran out: dead, holding its slots.
	d.exec(`UPDATE outbox_relay_members SET seen_until = now() - interval '1 second'`)
	code, st = d.status("--stream", d.stream(), "--key-prefix", d.keyPrefix())
	if code != exitFailure || !hasProblem(st, "relay r9 is dead and holds 16 partition slots") {
		t.Fatalf("membership ended: exit %d, %q", code, st.Problems)
	}
}

// status --light reads what the backlog costs, not the table (a table that
// keeps many published rows): the published rows are not counted, and says
// so, in JSON and in text; the backlog's figures are the same.
func TestStatusLightDoesNotCountThePublishedRows(t *testing.T) {
	t.Parallel()
	d := newDeployment(t)
	d.startRelay("r1")
	if code, _, stderr := run(t, d.env, "settle", "--count", "12", "--json"); code != exitOK {
		t.Fatalf("settle: exit %d %s", code, stderr)
	}
	var st status.Status
	outboxtest.Eventually(t, 20*time.Second, func() bool {
		_, st = d.status("--stream", d.stream(), "--key-prefix", d.keyPrefix())
		return st.Published == 12
	}, "the relay did not publish the 12 TEDs: %+v", func() any { return st })
	if !st.PublishedCounted {
		t.Fatalf("status without --light: published_counted false, %+v", st)
	}
	_, light := d.status("--light", "--stream", d.stream(), "--key-prefix", d.keyPrefix())
	if light.PublishedCounted || light.Published != 0 {
		t.Errorf("status --light: published %d, published_counted %v; want 0, false", light.Published, light.PublishedCounted)
	}
	if light.Pending != st.Pending || light.Dead != st.Dead || light.Retrying != st.Retrying || light.LiveRelays != 1 {
		t.Errorf("status --light disagrees with the full read on the backlog: %+v against %+v", light, st)
	}
	code, stdout, _ := run(t, d.env, "status", "--light", "--stream", d.stream(), "--key-prefix", d.keyPrefix())
	if !strings.Contains(stdout, "published not counted") {
		t.Errorf("status --light, text: exit %d, no \"published not counted\"\n%s", code, stdout)
	}
	_, stdout, _ = run(t, d.env, "status", "--stream", d.stream(), "--key-prefix", d.keyPrefix())
	if !strings.Contains(stdout, "published 12 ") {
		t.Errorf("status, text: no \"published 12\"\n%s", stdout)
	}
}
