package conformance

import (
	"context"
	"errors"
	"fmt"
	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/consumer/natssource"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer/inbox"
	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/natsjs"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/tcpproxy"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/relay/broker"
	"github.com/tedbank/outbox/relay/natsbroker"
	"github.com/tedbank/outbox/relay/redisbroker"
	"github.com/tedbank/outbox/transfer"
	"github.com/tedbank/outbox/transfer/settled"
)

// combination is one way to run the pipeline.
type combination struct {
	broker     string // "redis" or "nats"
	effect     string // "lua" (anti-fraud's script) or "inbox"
	ownership  string // relay.OwnRows or relay.OwnPartitions
	partitions int    // 1, or 4 (reached by the documented change from 1)
}

func (c combination) String() string {
	return fmt.Sprintf("%s-%s-%s-p%d", c.broker, c.effect, c.ownership, c.partitions)
}

func combinations() []combination {
	var all []combination
	for _, b := range []string{"redis", "nats"} {
		for _, e := range []string{"lua", "inbox"} {
			for _, o := range []string{relay.OwnRows, relay.OwnPartitions} {
				for _, p := range []int{1, 4} {
					all = append(all, combination{b, e, o, p})
				}
			}
		}
	}
	return all
}

// The consumer contract, every combination: no loss, exactly once in
// effect, each key's events in commit order, under the faults of the
// package comment.
func TestConformance(t *testing.T) {
	only := os.Getenv("CONFORMANCE_ONLY")
	for _, c := range combinations() {
		if only != "" && only != c.String() {
			continue
		}
		t.Run(c.String(), func(t *testing.T) {
			// Each combination has its database, key prefix and JetStream
			// stream of its own. CONFORMANCE_PARALLEL=1 runs them side by
			// side: a stress run (the schedules slower, the CPU busy),
			// which found a lost fetch reply on NATS. Not in make test:
			// under that load a consumer can legitimately miss its short
			// name lease and a twin take its name, which the run does not
			// expect (docs/development.md).
			if os.Getenv("CONFORMANCE_PARALLEL") != "" {
				t.Parallel()
			}
			newRun(t, c).run()
		})
	}
}

const (
	senders  = 6
	perPhase = 40 // TEDs per sender and phase
	flaky    = "acct-0"
	// lockedAccount receives the flaky sender's first TED (inbox).
	lockedAccount = "dest-locked"
	rate          = 8 * time.Millisecond // between settlements
)

// run is one combination's pipeline and what it saw.
type run struct {
	t      *testing.T
	c      combination
	ctx    context.Context
	pool   *pgxpool.Pool
	rdb    outboxtest.Redis
	js     jetstream.JetStream
	nats   string // the JetStream stream
	prefix string // the relays' stream prefix
	stream string // the consumed stream (base name)
	keys   string // the consumers' key prefix

	mu      sync.Mutex
	settled map[string][]uuid.UUID // event ids per sender, in commit order
	all     []uuid.UUID
	senders map[string]*sync.Mutex // senderLock
}

func newRun(t *testing.T, c combination) *run {
	r := &run{t: t, c: c, ctx: t.Context(), pool: outboxtest.Postgres(t), rdb: outboxtest.NewRedis(t), settled: map[string][]uuid.UUID{}}
	r.prefix = r.rdb.Prefix + "outbox.event."
	r.stream = r.prefix + "transfer"
	r.keys = r.rdb.Prefix + "c:"
	if c.broker == "nats" {
		nc, js, err := natsjs.Connect(outboxtest.NATSURL(t), "outbox-conformance")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		r.js, r.nats = js, outboxtest.NATSStream(t)
	}
	if c.effect == "inbox" {
		if _, err := inbox.Migrate(r.ctx, r.pool); err != nil {
			t.Fatal(err)
		}
		if _, err := r.pool.Exec(r.ctx, `
			CREATE TABLE conf_balances (account text PRIMARY KEY, n int NOT NULL DEFAULT 0);
			CREATE TABLE conf_effects (seq bigserial PRIMARY KEY, event_id uuid NOT NULL, sender text NOT NULL)`); err != nil {
			t.Fatal(err)
		}
	}
	return r
}

// run drives the load through its phases and faults, then checks.
func (r *run) run() {
	t := r.t
	// Phase 1 (P = 1 where the combination ends at 4): two relays, two
	// consumers (c1 reaches Redis through a proxy: the fault of being cut
	// from its lease store only).
	p1 := 1
	proxy, viaProxy := r.proxied()

	stopRelays := r.relays(p1, "a")
	c1 := r.consumer(viaProxy, "c1", p1)
	c2 := r.consumer(r.rdb.Client, "c2", p1)
	release := r.failKey(p1)

	load := r.settleInBackground(1)
	// The flaky key fails for a while in calm: the key's later events wait
	// behind it, the other keys flow.
	time.Sleep(1500 * time.Millisecond)
	release()
	// A twin under the live c2's name refuses to start.
	twin := r.newConsumer(r.rdb.Client, "c2", p1)
	tctx, tcancel := context.WithTimeout(r.ctx, 15*time.Second)
	if err := twin.Run(tctx); !errors.Is(err, consumer.ErrNameInUse) {
		t.Errorf("a twin under the running consumer c2's name: Run returned %v, want ErrNameInUse", err)
	}
	tcancel()
	// c1 is cut from Redis (its partition leases and its name's lease)
	// past its leases; a supervisor starts a replacement under its name
	// (through a proxy of its own); relays are killed between publish and
	// mark meanwhile; c1 comes back while events flow, finds its name
	// taken and stands down for good (whatever it read on its way back is
	// fenced, and the replacement applies it in order).
	stalled := c1
	proxy.Down()
	time.Sleep(1500 * time.Millisecond)
	proxy2, viaProxy2 := r.proxied()
	c1 = r.consumer(viaProxy2, "c1", p1)
	r.killBetweenPublishAndMark(8)
	time.Sleep(1000 * time.Millisecond)
	flowing := r.settleInBackground(3)
	time.Sleep(100 * time.Millisecond)
	proxy.Up()
	if err, ended := stalled.wait(10 * time.Second); !ended || !errors.Is(err, consumer.ErrNameInUse) {
		t.Errorf("c1, back from its stall with a replacement running under its name: ended %v with %v, want ErrNameInUse", ended, err)
	}
	proxy, viaProxy = proxy2, viaProxy2
	load.Wait()
	flowing.Wait()

	if r.c.partitions == 1 {
		// c1 crashes holding partitions and entries: cut for good, its
		// Run ended with nothing of its own cleanup reaching Redis.
		more := r.settleInBackground(2)
		time.Sleep(200 * time.Millisecond)
		proxy.Down()
		c1.stop()
		more.Wait()
		r.waitApplied()
		stopRelays()
		c2.stop()
		r.check(p1)
		return
	}

	// The documented change to P = 4 (docs/operations.md): stop the
	// relays, leaving one killed between its publish and its mark; let the
	// consumers drain; stop them; start the consumers with 4, then the
	// relays.
	stopRelays()
	// Step 2 drains what the relays published; events they had not
	// published yet wait in the outbox for the relays of the new layout.
	published := r.publishedIDs()
	r.killBetweenPublishAndMark(1)
	r.waitTakenEffect(published)
	c1.stop()
	c2.stop()
	proxy.Up()
	c1 = r.consumer(viaProxy, "c1", 4)
	c2 = r.consumer(r.rdb.Client, "c2", 4)
	stop4 := r.relays(4, "b")
	more := r.settleInBackground(2)
	// c1 crashes holding two of the four partitions and their entries.
	time.Sleep(400 * time.Millisecond)
	proxy.Down()
	c1.stop()
	more.Wait()
	r.waitApplied()
	stop4()
	r.check(4)
}

// relays starts two relays with p partitions; stop stops them.
func (r *run) relays(p int, gen string) (stop func()) {
	r.t.Helper()
	var stops []func()
	for i := range 2 {
		cfg := relay.Config{Name: fmt.Sprintf("r%s%d", gen, i), StreamPrefix: r.prefix, Ownership: r.c.ownership, Partitions: p,
			PollInterval: time.Second, Lease: 2 * time.Second, ReapInterval: 300 * time.Millisecond}
		// Half the combinations publish CloudEvents attributes too: the
		// consumers read their own fields alongside.
		ce := broker.CloudEvents{Enabled: r.c.partitions == 4}
		var rl *relay.Relay
		var err error
		if r.c.broker == "nats" {
			rl, err = natsbroker.NewRelay(r.pool, natsbroker.Config{JS: r.js, Stream: r.nats, CloudEvents: ce}, cfg)
		} else {
			var b *redisbroker.Broker
			if b, err = redisbroker.New(r.rdb.Client, redisbroker.Config{CloudEvents: ce}); err == nil {
				rl, err = relay.New(r.pool, b, cfg)
			}
		}
		if err != nil {
			r.t.Fatal(err)
		}
		stops = append(stops, r.background("relay "+cfg.Name, rl.Run).stop)
	}
	return func() {
		for _, s := range stops {
			s()
		}
	}
}

func (r *run) consumer(rdb redis.Cmdable, name string, p int) *running {
	c := r.newConsumer(rdb, name, p)
	return r.background("consumer "+name, c.Run)
}

// proxied returns a client of the test's Redis through a proxy of its own,
// which the test can cut (Down) for that client alone.
func (r *run) proxied() (*tcpproxy.Proxy, *redis.Client) {
	r.t.Helper()
	proxy, err := tcpproxy.Start(r.rdb.Options().Addr)
	if err != nil {
		r.t.Fatal(err)
	}
	r.t.Cleanup(func() { proxy.Close() })
	opt := *r.rdb.Options()
	opt.Addr, opt.MaxRetries = proxy.Addr(), -1
	c := redis.NewClient(&opt)
	r.t.Cleanup(func() { c.Close() })
	return proxy, c
}

// runner is what the combinations' consumers have in common.
type runner interface {
	Run(ctx context.Context) error
}

func (r *run) newConsumer(rdb redis.Cmdable, name string, p int) runner {
	r.t.Helper()
	var c runner
	var err error
	switch r.c.effect {
	case "lua":
		cfg := fraud.Config{Config: consumer.Config{Stream: r.stream, KeyPrefix: r.keys, Consumer: name, Block: 100 * time.Millisecond, ClaimInterval: 500 * time.Millisecond, ClaimMinIdle: 3 * time.Second, Partitions: p, PartitionLease: time.Second}, AuditLen: 100_000}
		if r.c.broker == "nats" {
			c, err = fraud.NewWithSource(rdb, natssource.New(r.js), cfg)
		} else {
			c, err = fraud.New(rdb, cfg)
		}
	case "inbox":
		in, ierr := inbox.New(r.pool, batchEffect{r}, inbox.Config{})
		if ierr != nil {
			r.t.Fatal(ierr)
		}
		cfg := consumer.Config{Name: "conformance", Stream: r.stream, KeyPrefix: r.keys, Consumer: name, Block: 100 * time.Millisecond,
			ClaimInterval: 500 * time.Millisecond, ClaimMinIdle: 3 * time.Second, Partitions: p, PartitionLease: time.Second}
		if r.c.broker == "nats" {
			c, err = consumer.NewWithSource(rdb, natssource.New(r.js), in, cfg)
		} else {
			c, err = consumer.New(rdb, in, cfg)
		}
	}
	if err != nil {
		r.t.Fatal(err)
	}
	return c
}

// applyTx is the inbox's effect: the receiving account's balance row,
// under a short lock timeout (another transaction holding it fails the
// effect, as in production), and the effect's record.
func (r *run) applyTx(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
	ev, err := settled.Decode(m.Payload)
	if err != nil {
		return consumer.Invalid("%v", err)
	}
	if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '200ms'`); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `INSERT INTO conf_balances (account, n) VALUES ($1, 1)
		ON CONFLICT (account) DO UPDATE SET n = conf_balances.n + 1`, ev.ToAccount); err != nil {
		return err
	}
	_, err = tx.Exec(ctx, `INSERT INTO conf_effects (event_id, sender) VALUES ($1, $2)`, ev.EventID, ev.FromAccount)
	return err
}

// batchEffect is the inbox's effect as an inbox.BatchHandler: a batch's
// new messages in three statements (as the ledger posts them), and each
// message alone (applyTx) when the inbox falls back to one by one after a
// batch failed, or for a batch of one.
type batchEffect struct{ r *run }

func (b batchEffect) HandleTx(ctx context.Context, tx pgx.Tx, m consumer.Message) error {
	return b.r.applyTx(ctx, tx, m)
}

func (batchEffect) HandleBatchTx(ctx context.Context, tx pgx.Tx, msgs []consumer.Message) error {
	ids, senders, to := make([]uuid.UUID, len(msgs)), make([]string, len(msgs)), make([]string, len(msgs))
	for i, m := range msgs {
		ev, err := settled.Decode(m.Payload)
		if err != nil {
			return consumer.Invalid("%v", err)
		}
		ids[i], senders[i], to[i] = ev.EventID, ev.FromAccount, ev.ToAccount
	}
	if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '200ms'`); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `INSERT INTO conf_balances (account, n)
		SELECT account, count(*) FROM unnest($1::text[]) AS a(account) GROUP BY account ORDER BY account
		ON CONFLICT (account) DO UPDATE SET n = conf_balances.n + excluded.n`, to); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, `INSERT INTO conf_effects (event_id, sender)
		SELECT event_id, sender FROM unnest($1::uuid[], $2::text[]) WITH ORDINALITY AS e(event_id, sender, n) ORDER BY n`, ids, senders)
	return err
}

// failKey makes effects of the flaky sender fail until release. Inbox: the
// receiving account of its first TED (lockedAccount) has its balance row
// locked, so that TED fails with lock_timeout while the sender's next ones,
// to other accounts, would succeed: they must wait for it. Lua: the
// sender's day totals key is of the wrong type (WRONGTYPE, which the script
// checks before any write): every effect of the sender fails meanwhile (the
// script's keys that could fail are the sender's or the partition's, none
// is one event's).
func (r *run) failKey(p int) (release func()) {
	r.t.Helper()
	switch r.c.effect {
	case "inbox":
		if _, err := r.pool.Exec(r.ctx, `INSERT INTO conf_balances (account) VALUES ($1)`, lockedAccount); err != nil {
			r.t.Fatal(err)
		}
		tx, err := r.pool.Begin(r.ctx)
		if err != nil {
			r.t.Fatal(err)
		}
		if _, err := tx.Exec(r.ctx, `SELECT 1 FROM conf_balances WHERE account = $1 FOR UPDATE`, lockedAccount); err != nil {
			r.t.Fatal(err)
		}
		return func() { _ = tx.Rollback(r.ctx) }
	default:
		day, _ := fraud.Day(time.Now())
		key := fraud.Keys{Prefix: r.keys, Partitions: p}.Sender(flaky).DayAccount(day, flaky)
		if err := r.rdb.Set(r.ctx, key, "not a hash", time.Minute).Err(); err != nil {
			r.t.Fatal(err)
		}
		return func() { r.rdb.Del(r.ctx, key) }
	}
}

// settleInBackground settles perPhase TEDs of every sender, round robin,
// each in a transaction of its own.
func (r *run) settleInBackground(phase int) *sync.WaitGroup {
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := range perPhase * senders {
			from, to := fmt.Sprintf("acct-%d", i%senders), fmt.Sprintf("dest-%d-%d", phase, i)
			if phase == 1 && i == 0 {
				to = lockedAccount // the flaky sender's first TED
			}
			// A sender's TEDs commit one at a time, as an account's
			// transfers do: two phases settle at once, and the order in
			// which two concurrent Settle calls of one sender returned
			// need not be the order in which they committed.
			lock := r.senderLock(from)
			lock.Lock()
			res, err := transfer.Settle(r.ctx, r.pool, transfer.Transfer{ID: uuid.New(), FromAccount: from, ToAccount: to, AmountCents: 100})
			if err == nil {
				r.mu.Lock()
				r.settled[from] = append(r.settled[from], res.EventID)
				r.all = append(r.all, res.EventID)
				r.mu.Unlock()
			}
			lock.Unlock()
			if err != nil {
				r.t.Errorf("settle: %v", err)
				return
			}
			time.Sleep(rate)
		}
	})
	return &wg
}

// senderLock is the lock a sender's settlements hold from their start to
// their recording.
func (r *run) senderLock(sender string) *sync.Mutex {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.senders == nil {
		r.senders = map[string]*sync.Mutex{}
	}
	l, ok := r.senders[sender]
	if !ok {
		l = &sync.Mutex{}
		r.senders[sender] = l
	}
	return l
}

// killBetweenPublishAndMark leaves n published events as a relay killed
// between its publish and its mark leaves them: 'publishing', claimed past
// its lease (within the redelivery window). The reaper returns them to
// pending and a relay publishes them again: copies, later in the stream
// than newer events of their keys.
func (r *run) killBetweenPublishAndMark(n int) {
	r.t.Helper()
	if _, err := r.pool.Exec(r.ctx, `
		UPDATE outbox_messages SET status = 'publishing', claimed_at = now() - interval '10 seconds', claimed_by = 'killed',
		       claim_token = gen_random_uuid(), published_at = NULL, stream_id = NULL
		 WHERE id IN (SELECT id FROM outbox_messages WHERE status = 'published' ORDER BY random() LIMIT $1)`, n); err != nil {
		r.t.Fatal(err)
	}
}

// running is a function running in the background: a relay or a consumer.
type running struct {
	stop func()
	// wait waits up to d for it to end by itself, and returns what it
	// returned; an end waited for is not reported again by stop.
	wait func(d time.Duration) (err error, ended bool)
}

// background runs fn until the test ends or stop is called; stop reports
// an error fn returned, unless wait returned it.
func (r *run) background(what string, fn func(context.Context) error) *running {
	ctx, cancel := context.WithCancel(r.ctx)
	done := make(chan struct{})
	var err error
	go func() { err = fn(ctx); close(done) }()
	var waited bool
	var once sync.Once
	rn := &running{}
	rn.wait = func(d time.Duration) (error, bool) {
		select {
		case <-done:
			waited = true
			return err, true
		case <-time.After(d):
			return nil, false
		}
	}
	rn.stop = func() {
		once.Do(func() {
			cancel()
			select {
			case <-done:
				if err != nil && !errors.Is(err, context.Canceled) && !waited {
					r.t.Errorf("%s: %v", what, err)
				}
			case <-time.After(20 * time.Second):
				r.t.Errorf("%s did not stop within 20s", what)
			}
		})
	}
	r.t.Cleanup(rn.stop)
	return rn
}

// applied returns, per sender, the events in the order they took effect,
// and how often each took effect.
func (r *run) applied(p int) (map[string][]uuid.UUID, map[uuid.UUID]int) {
	r.t.Helper()
	order, count := map[string][]uuid.UUID{}, map[uuid.UUID]int{}
	add := func(sender string, id uuid.UUID) {
		count[id]++
		order[sender] = append(order[sender], id)
	}
	switch r.c.effect {
	case "inbox":
		rows, _ := r.pool.Query(r.ctx, `SELECT event_id, sender FROM conf_effects ORDER BY seq`)
		var id uuid.UUID
		var sender string
		if _, err := pgx.ForEachRow(rows, []any{&id, &sender}, func() error { add(sender, id); return nil }); err != nil {
			r.t.Fatal(err)
		}
	default:
		// Each layout's audit streams, the earlier layout first: a
		// sender's effects are in its partition's, in the order applied.
		layouts := []int{1}
		if p != 1 {
			layouts = append(layouts, p)
		}
		for _, n := range layouts {
			for _, k := range (fraud.Keys{Prefix: r.keys, Partitions: n}).Each() {
				msgs, err := r.rdb.XRange(r.ctx, k.Audit(), "-", "+").Result()
				if err != nil {
					r.t.Fatal(err)
				}
				for _, m := range msgs {
					id, err := uuid.Parse(fmt.Sprint(m.Values["event_id"]))
					if err != nil {
						r.t.Fatalf("audit entry %v: %v", m.Values, err)
					}
					add(fmt.Sprint(m.Values["from_account"]), id)
				}
			}
		}
	}
	return order, count
}

// waitApplied waits until every event settled so far has taken effect.
func (r *run) waitApplied() {
	r.t.Helper()
	r.mu.Lock()
	all := slices.Clone(r.all)
	r.mu.Unlock()
	r.waitTakenEffect(all)
}

// waitTakenEffect waits until every event of ids has taken effect.
func (r *run) waitTakenEffect(ids []uuid.UUID) {
	r.t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		_, count := r.applied(r.c.partitions)
		var missing []uuid.UUID
		for _, id := range ids {
			if count[id] == 0 {
				missing = append(missing, id)
			}
		}
		if len(missing) == 0 {
			return
		}
		if time.Now().After(deadline) {
			var status []string
			if err := r.pool.QueryRow(r.ctx, `SELECT coalesce(array_agg(format('%s %s (attempts %s, claimed by %s)', id, status, attempts, claimed_by)), '{}')
				FROM outbox_messages WHERE id = ANY($1)`, missing).Scan(&status); err != nil {
				r.t.Fatal(err)
			}
			r.t.Fatalf("after 60s %d of %d events have taken effect; in the outbox the others are: %v", len(ids)-len(missing), len(ids), status)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// publishedIDs are the events the outbox has marked published.
func (r *run) publishedIDs() []uuid.UUID {
	r.t.Helper()
	var ids []uuid.UUID
	if err := r.pool.QueryRow(r.ctx, `SELECT coalesce(array_agg(id), '{}') FROM outbox_messages WHERE status = 'published'`).Scan(&ids); err != nil {
		r.t.Fatal(err)
	}
	return ids
}

// check asserts the contract over everything settled.
func (r *run) check(p int) {
	r.t.Helper()
	order, count := r.applied(p)
	r.mu.Lock()
	defer r.mu.Unlock()
	var lost, doubled []string
	for _, id := range r.all {
		switch n := count[id]; {
		case n == 0:
			lost = append(lost, id.String())
		case n > 1:
			doubled = append(doubled, fmt.Sprintf("%s x%d", id, n))
		}
	}
	if len(lost) > 0 || len(doubled) > 0 {
		r.t.Errorf("%d of %d events lost %v, %d applied more than once %v", len(lost), len(r.all), lost, len(doubled), doubled)
	}
	for sender, want := range r.settled {
		if got := order[sender]; !slices.Equal(got, want) {
			r.t.Errorf("sender %s: %d effects out of commit order:\n got %s\nwant %s", sender, outOfOrder(got, want), short(got), short(want))
		}
	}
	if !r.t.Failed() {
		r.t.Logf("%s: %d events, each applied once, every key in commit order", r.c, len(r.all))
	}
}

// outOfOrder counts the effects that came after an effect settled later.
func outOfOrder(got, want []uuid.UUID) int {
	pos := map[uuid.UUID]int{}
	for i, id := range want {
		pos[id] = i
	}
	n, last := 0, -1
	for _, id := range got {
		if p, ok := pos[id]; ok {
			if p < last {
				n++
			}
			last = max(last, p)
		}
	}
	return n
}

func short(ids []uuid.UUID) string {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = id.String()[24:] // the random end (a version 7 id starts with its time)
	}
	return strings.Join(s, " ")
}
