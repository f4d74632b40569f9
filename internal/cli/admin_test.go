package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/partition"
)

func TestAdminBadCommandLinesExitTwoWithOneLine(t *testing.T) {
	id := uuid.NewString()
	for _, args := range [][]string{
		{"dead"},
		{"dead", "purge"},
		{"dead", "list", "extra"},
		{"dead", "list", "--limit", "0"},
		{"dead", "retry"},
		{"dead", "retry", "--all", id},
		{"dead", "retry", id, "--all"},
		{"dead", "retry", "not-a-uuid"},
		{"dead", "retry", id, "not-a-uuid"},
		{"dead", "retry", "--all", "--batch", "0"},
		{"dead", "retry", "--nope", id},
		{"cleanup"},
		{"cleanup", "--older-than", "0s"},
		{"cleanup", "--older-than", "-1h"},
		{"cleanup", "--older-than", "soon"},
		{"cleanup", "--older-than", "1h", "--batch", "0"},
		{"cleanup", "--older-than", "1h", "extra"},
		{"fraud", "dlq"},
		{"fraud", "dlq", "purge"},
		{"fraud", "dlq", "list", "--count", "0"},
		{"fraud", "dlq", "list", "--key-prefix", "a b"},
		{"fraud", "dlq", "retry"},
		{"fraud", "dlq", "retry", "--all", "1-0"},
		{"fraud", "dlq", "retry", "abc"},
		{"fraud", "dlq", "retry", "1700000000000"},
		{"fraud", "dlq", "retry", "--all", "--stream", "a b"},
	} {
		code, stdout, stderr := run(t, nil, args...)
		if code != exitUsage || stdout != "" || strings.Count(strings.TrimSpace(stderr), "\n") != 0 || stderr == "" {
			t.Errorf("%v: exit %d, stdout %q, stderr %q; want exit 2 and one line on stderr", args, code, stdout, stderr)
		}
	}
}

func TestAdminHelpExitsZero(t *testing.T) {
	for _, args := range [][]string{
		{"dead", "-h"}, {"dead", "list", "-h"}, {"dead", "retry", "-h"}, {"cleanup", "-h"},
		{"fraud", "dlq", "-h"}, {"fraud", "dlq", "list", "-h"}, {"fraud", "dlq", "retry", "--help"},
	} {
		code, stdout, stderr := run(t, nil, args...)
		if code != exitOK || stdout != "" || !strings.Contains(stderr, "usage: outbox ") {
			t.Errorf("%v: exit %d, stdout %q, stderr %q; want exit 0 and the usage on stderr", args, code, stdout, stderr)
		}
	}
}

func TestAdminUnreachableServerIsOneClearLine(t *testing.T) {
	env := map[string]string{
		"DATABASE_URL": "postgres://app:s3cret-pw@127.0.0.1:1/db?sslmode=disable&connect_timeout=2",
		"REDIS_URL":    "redis://:r3dis-pw@127.0.0.1:1/0",
	}
	for _, args := range [][]string{
		{"dead", "list"}, {"dead", "retry", "--all"}, {"dead", "retry", uuid.NewString()},
		{"cleanup", "--older-than", "7d"}, {"fraud", "dlq", "list"}, {"fraud", "dlq", "retry", "--all"},
	} {
		code, stdout, stderr := run(t, env, args...)
		if code != exitFailure || stdout != "" || strings.Count(strings.TrimSpace(stderr), "\n") != 0 || !strings.Contains(stderr, "cannot reach") {
			t.Errorf("%v: exit %d, stdout %q, stderr %q; want exit 1 and one 'cannot reach' line", args, code, stdout, stderr)
		}
		if strings.Contains(stderr, "s3cret-pw") || strings.Contains(stderr, "r3dis-pw") {
			t.Errorf("%v: password leaked: %s", args, stderr)
		}
	}
}

// adminDB is a migrated database with helpers to put rows in each status.
type adminDB struct {
	t    *testing.T
	url  string
	pool *pgxpool.Pool
	env  map[string]string
}

func newAdminDB(t *testing.T) *adminDB {
	url := outboxtest.PostgresURL(t)
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return &adminDB{t: t, url: url, pool: pool, env: map[string]string{"DATABASE_URL": url}}
}

// row inserts an outbox row and runs update (with the row's id as $1) on it.
func (d *adminDB) row(aggID, update string) string {
	d.t.Helper()
	ctx := context.Background()
	var id string
	err := d.pool.QueryRow(ctx, `INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload)
		VALUES ('order', $1, 'order.placed', '{}') RETURNING id::text`, aggID).Scan(&id)
	if err != nil {
		d.t.Fatal(err)
	}
	if update != "" {
		if _, err := d.pool.Exec(ctx, update, id); err != nil {
			d.t.Fatal(err)
		}
	}
	return id
}

func (d *adminDB) status(id string) string {
	d.t.Helper()
	var s string
	if err := d.pool.QueryRow(context.Background(), "SELECT status FROM outbox_messages WHERE id = $1", id).Scan(&s); err != nil {
		return "gone"
	}
	return s
}

const (
	sqlDead = `UPDATE outbox_messages SET status = 'dead', attempts = 10,
		last_error = 'WRONGTYPE Operation against a key holding the wrong kind of value' WHERE id = $1`
	sqlPublished    = `UPDATE outbox_messages SET status = 'published', published_at = now() WHERE id = $1`
	sqlOldPublished = `UPDATE outbox_messages SET status = 'published', published_at = now() - interval '3 days' WHERE id = $1`
)

func TestDeadListAndRetryCommands(t *testing.T) {
	d := newAdminDB(t)
	code, stdout, stderr := run(t, d.env, "dead", "list", "--json")
	if code != exitOK || strings.TrimSpace(stdout) != "[]" {
		t.Fatalf("dead list --json on an empty outbox: exit %d, %q %s; want []", code, stdout, stderr)
	}
	dead := d.row("o-1", sqlDead)
	pending := d.row("o-2", "")
	published := d.row("o-3", sqlPublished)

	code, stdout, stderr = run(t, d.env, "dead", "list", "--json")
	if code != exitOK {
		t.Fatalf("dead list --json: exit %d %s", code, stderr)
	}
	var list []map[string]any
	if err := json.Unmarshal([]byte(stdout), &list); err != nil || len(list) != 1 {
		t.Fatalf("dead list --json printed %s (err %v); want an array of one", stdout, err)
	}
	keys := slices.Sorted(maps.Keys(list[0]))
	want := []string{"aggregate_id", "aggregate_type", "attempts", "created_at", "event_id", "event_type", "last_error"}
	if !slices.Equal(keys, want) {
		t.Fatalf("dead event keys %v, want %v", keys, want)
	}
	if list[0]["event_id"] != dead || list[0]["attempts"] != float64(10) || list[0]["aggregate_id"] != "o-1" ||
		!strings.HasPrefix(list[0]["last_error"].(string), "WRONGTYPE") {
		t.Fatalf("dead event %v", list[0])
	}

	code, stdout, _ = run(t, d.env, "dead", "list")
	if code != exitOK || !strings.Contains(stdout, dead) || !strings.Contains(stdout, "order/o-1") || !strings.Contains(stdout, "1 dead event") {
		t.Fatalf("dead list: exit %d\n%s", code, stdout)
	}

	// A malformed id is a usage error and nothing is written, not even for
	// the valid id beside it.
	code, _, stderr = run(t, d.env, "dead", "retry", dead, "nope")
	if code != exitUsage || !strings.Contains(stderr, `"nope"`) || d.status(dead) != "dead" {
		t.Fatalf("retry with a malformed id: exit %d %q, status %s; want exit 2 and the row still dead", code, stderr, d.status(dead))
	}

	// Non-dead and unknown ids are left alone, reported, and fail the command;
	// the dead one is requeued.
	unknown := uuid.NewString()
	code, stdout, stderr = run(t, d.env, "dead", "retry", dead, pending, published, unknown)
	if code != exitFailure || strings.TrimSpace(stdout) != "requeued 1 dead event" {
		t.Fatalf("dead retry: exit %d, stdout %q, stderr %q", code, stdout, stderr)
	}
	for _, s := range []string{pending + " is pending", published + " is published", unknown + " does not exist", "3 of 4"} {
		if !strings.Contains(stderr, s) {
			t.Errorf("stderr %q lacks %q", stderr, s)
		}
	}
	if strings.Count(strings.TrimSpace(stderr), "\n") != 0 {
		t.Errorf("stderr is more than one line: %q", stderr)
	}
	if d.status(dead) != "pending" || d.status(pending) != "pending" || d.status(published) != "published" {
		t.Fatalf("statuses %s %s %s after retry", d.status(dead), d.status(pending), d.status(published))
	}

	// --all, with flags after the ids position too.
	d.row("o-4", sqlDead)
	d.row("o-5", sqlDead)
	code, stdout, stderr = run(t, d.env, "dead", "retry", "--all", "--batch", "1")
	if code != exitOK || strings.TrimSpace(stdout) != "requeued 2 dead events" {
		t.Fatalf("dead retry --all: exit %d, %q %s", code, stdout, stderr)
	}
	code, stdout, _ = run(t, d.env, "dead", "list")
	if code != exitOK || strings.TrimSpace(stdout) != "no dead events" {
		t.Fatalf("dead list after retry --all: exit %d %q", code, stdout)
	}
	dead2 := d.row("o-6", sqlDead)
	code, stdout, stderr = run(t, d.env, "dead", "retry", dead2, "--log-level", "debug")
	if code != exitOK || strings.TrimSpace(stdout) != "requeued 1 dead event" || !strings.Contains(stderr, dead2) {
		t.Fatalf("dead retry <id> --log-level debug: exit %d, %q %q", code, stdout, stderr)
	}
}

func TestCleanupCommand(t *testing.T) {
	d := newAdminDB(t)
	var old []string
	for i := range 5 {
		old = append(old, d.row("o-"+string(rune('a'+i)), sqlOldPublished))
	}
	fresh := d.row("n-1", sqlPublished)
	pending := d.row("n-2", `UPDATE outbox_messages SET created_at = now() - interval '30 days' WHERE id = $1`)
	dead := d.row("n-3", sqlDead)
	if _, err := d.pool.Exec(context.Background(), "UPDATE outbox_messages SET created_at = now() - interval '30 days' WHERE id = $1", dead); err != nil {
		t.Fatal(err)
	}

	code, stdout, stderr := run(t, d.env, "cleanup", "--older-than", "2d", "--batch", "2", "--json")
	if code != exitOK {
		t.Fatalf("cleanup: exit %d %s", code, stderr)
	}
	var res map[string]any
	if err := json.Unmarshal([]byte(stdout), &res); err != nil {
		t.Fatalf("cleanup --json printed %q: %v", stdout, err)
	}
	keys := slices.Sorted(maps.Keys(res))
	if want := []string{"batches", "cutoff", "deleted", "elapsed_ms", "older_than_seconds"}; !slices.Equal(keys, want) {
		t.Fatalf("cleanup --json keys %v, want %v", keys, want)
	}
	if res["deleted"] != float64(5) || res["batches"] != float64(3) || res["older_than_seconds"] != float64(2*86400) {
		t.Fatalf("cleanup --json %s: want 5 deleted in 3 batches, 2 days", stdout)
	}
	for _, id := range old {
		if s := d.status(id); s != "gone" {
			t.Errorf("old published row %s is %s, want deleted", id, s)
		}
	}
	for _, id := range []string{fresh, pending, dead} {
		if s := d.status(id); s == "gone" {
			t.Errorf("row %s was deleted", id)
		}
	}
	code, stdout, _ = run(t, d.env, "cleanup", "--older-than", "36h")
	if code != exitOK || !strings.HasPrefix(stdout, "deleted 0 published rows (published before ") {
		t.Fatalf("second cleanup: exit %d %q", code, stdout)
	}
}

func TestFraudDLQCommands(t *testing.T) {
	ctx := context.Background()
	rdb := outboxtest.NewRedis(t)
	env := map[string]string{"REDIS_URL": rdb.URL}
	prefix := rdb.Prefix + "fraud:"
	stream := rdb.Prefix + "outbox.event.transfer"

	code, stdout, stderr := run(t, env, "fraud", "dlq", "list", "--json", "--key-prefix", prefix)
	if code != exitOK || strings.TrimSpace(stdout) != "[]" {
		t.Fatalf("fraud dlq list --json, empty: exit %d, %q %s; want []", code, stdout, stderr)
	}
	eventID := uuid.NewString()
	letter := map[string]any{
		"event_id": eventID, "event_type": "transfer.settled", "aggregate_id": "t-1", "payload": "not json",
		"dlq_stream": stream, "dlq_group": "fraud", "dlq_entry_id": "1700000000000-0",
		"dlq_reason": `invalid event: payload {"total_cents": 990, "items": [` + strings.Repeat(`{"sku": "x"}, `, 20) + `]}: ` +
			"invalid character 'n' looking for beginning of value", "dlq_deliveries": "5", "dlq_consumer": "c1",
	}
	id, err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: prefix + "dlq", Values: letter}).Result()
	if err != nil {
		t.Fatal(err)
	}

	code, stdout, stderr = run(t, env, "fraud", "dlq", "list", "--json", "--key-prefix", prefix)
	if code != exitOK {
		t.Fatalf("fraud dlq list --json: exit %d %s", code, stderr)
	}
	var list []map[string]any
	if err := json.Unmarshal([]byte(stdout), &list); err != nil || len(list) != 1 {
		t.Fatalf("fraud dlq list --json printed %s (err %v); want an array of one", stdout, err)
	}
	keys := slices.Sorted(maps.Keys(list[0]))
	want := []string{"aggregate_id", "dlq_consumer", "dlq_deliveries", "dlq_entry_id", "dlq_group", "dlq_reason",
		"dlq_stream", "event_id", "event_type", "fields", "id"}
	if !slices.Equal(keys, want) {
		t.Fatalf("dead letter keys %v, want %v", keys, want)
	}
	if l := list[0]; l["id"] != id || l["event_id"] != eventID || l["dlq_deliveries"] != float64(5) || l["dlq_stream"] != stream ||
		len(l["fields"].(map[string]any)) != 4 {
		t.Fatalf("dead letter %v", l)
	}
	code, stdout, _ = run(t, env, "fraud", "dlq", "list", "--key-prefix", prefix)
	if code != exitOK || !strings.Contains(stdout, id) || !strings.Contains(stdout, eventID) || !strings.Contains(stdout, "1 dead letter") ||
		!strings.Contains(stdout, "invalid event: payload {") || !strings.Contains(stdout, "looking for beginning of value") {
		t.Fatalf("fraud dlq list: exit %d\n%s\nwant the reason's start and its cause, at its end", code, stdout)
	}
	// The general name lists the same, and names itself in its errors.
	if code, general, _ := run(t, env, "dlq", "list", "--key-prefix", prefix); code != exitOK || general != stdout {
		t.Fatalf("dlq list: exit %d\n%s\nwant what fraud dlq list printed:\n%s", code, general, stdout)
	}
	if code, _, stderr := run(t, env, "dlq", "retry", "--key-prefix", prefix); code != exitUsage || !strings.Contains(stderr, "see 'outbox dlq list'") {
		t.Fatalf("dlq retry without ids: exit %d %q", code, stderr)
	}

	// An unknown id fails the command after the others are retried.
	code, stdout, stderr = run(t, env, "fraud", "dlq", "retry", "--key-prefix", prefix, id, "1-1")
	if code != exitFailure || !strings.HasPrefix(stdout, "retried 1 dead letter (re-added to "+stream+")") ||
		!strings.Contains(stderr, "1-1 is not in "+prefix+"dlq") {
		t.Fatalf("fraud dlq retry: exit %d, stdout %q, stderr %q", code, stdout, stderr)
	}
	msgs, err := rdb.XRange(ctx, stream, "-", "+").Result()
	if err != nil || len(msgs) != 1 || msgs[0].Values["event_id"] != eventID || msgs[0].Values["dlq_reason"] != nil {
		t.Fatalf("source stream %v (err %v): want the original fields re-added", msgs, err)
	}
	code, stdout, _ = run(t, env, "fraud", "dlq", "list", "--key-prefix", prefix)
	if code != exitOK || strings.TrimSpace(stdout) != "no dead letters in "+prefix+"dlq" {
		t.Fatalf("fraud dlq list after retry: exit %d %q", code, stdout)
	}
	code, stdout, stderr = run(t, env, "fraud", "dlq", "retry", "--all", "--key-prefix", prefix, "--stream", stream)
	if code != exitOK || strings.TrimSpace(stdout) != "retried 0 dead letters" {
		t.Fatalf("fraud dlq retry --all on an empty dead-letter stream: exit %d %q %s", code, stdout, stderr)
	}
}

// With partitions each partition's state has its own dead-letter stream:
// fraud dlq list shows them together, oldest first, and retry finds an id in
// whichever holds it.
func TestFraudDLQCommandsOverPartitions(t *testing.T) {
	ctx := context.Background()
	rdb := outboxtest.NewRedis(t)
	env := map[string]string{"REDIS_URL": rdb.URL, "OUTBOX_PARTITIONS": "2"}
	prefix := rdb.Prefix + "fraud:"
	stream := rdb.Prefix + "outbox.event.transfer"
	var ids []string
	for i, p := range []int{1, 0} { // the older letter in partition 1
		source := partition.Stream(stream, p, 2)
		id, err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: partition.Prefix(prefix, p, 2) + "dlq", ID: fmt.Sprintf("170000000000%d-0", i), Values: map[string]any{
			"event_id": uuid.NewString(), "event_type": "transfer.settled", "payload": "not json",
			"dlq_stream": source, "dlq_group": "fraud", "dlq_entry_id": fmt.Sprintf("1700000000000-%d", i),
			"dlq_reason": "invalid event", "dlq_deliveries": "5", "dlq_consumer": "c1",
		}}).Result()
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	code, stdout, stderr := run(t, env, "fraud", "dlq", "list", "--json", "--key-prefix", prefix)
	var list []map[string]any
	if code != exitOK || json.Unmarshal([]byte(stdout), &list) != nil || len(list) != 2 ||
		list[0]["id"] != ids[0] || list[1]["id"] != ids[1] || list[0]["dlq_stream"] != partition.Stream(stream, 1, 2) {
		t.Fatalf("fraud dlq list over 2 partitions: exit %d %s %s; want both letters, oldest first", code, stdout, stderr)
	}
	code, stdout, stderr = run(t, env, "fraud", "dlq", "retry", "--key-prefix", prefix, ids[1], "1-1")
	if code != exitFailure || !strings.HasPrefix(stdout, "retried 1 dead letter (re-added to "+partition.Stream(stream, 0, 2)+")") ||
		!strings.Contains(stderr, "1-1 is not in any of the 2 partitions' dead-letter streams") {
		t.Fatalf("fraud dlq retry: exit %d, stdout %q, stderr %q", code, stdout, stderr)
	}
	code, stdout, stderr = run(t, env, "fraud", "dlq", "retry", "--all", "--key-prefix", prefix, "--stream", stream)
	if code != exitOK || strings.TrimSpace(stdout) != "retried 1 dead letter (re-added to "+partition.Stream(stream, 1, 2)+")" {
		t.Fatalf("fraud dlq retry --all: exit %d %q %s", code, stdout, stderr)
	}
	code, stdout, _ = run(t, env, "fraud", "dlq", "list", "--key-prefix", prefix)
	if code != exitOK || strings.TrimSpace(stdout) != "no dead letters in the 2 partitions' dead-letter streams" {
		t.Fatalf("fraud dlq list after the retries: exit %d %q", code, stdout)
	}
}
