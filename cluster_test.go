package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/internal/relaytest"
	"github.com/tedbank/outbox/internal/testenv"
	"github.com/tedbank/outbox/partition"
	"github.com/tedbank/outbox/reconcile"
	"github.com/tedbank/outbox/relay/redisbroker"
	"github.com/tedbank/outbox/transfer"
)

// The outbox on a Redis Cluster of three masters and three replicas (local
// redis-server processes, one cluster for all the subtests): relays and
// consumers with four partitions, with and without replica acknowledgement,
// the admin commands, reconcile and the demo.
func TestOnRedisCluster(t *testing.T) {
	// Its own cluster, databases and key prefixes, and no bound on time:
	// beside the others.
	t.Parallel()
	cluster, err := testenv.LocalRedisCluster(t.Context(), testenv.Options{})
	if err != nil {
		t.Fatalf("start a Redis Cluster: %v", err)
	}
	t.Cleanup(func() { _ = cluster.Close() })
	cc, err := cluster.Client()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })

	for _, minReplicas := range []int{0, 1} {
		t.Run(fmt.Sprintf("min-replicas=%d", minReplicas), func(t *testing.T) {
			f := newFixture(t)
			f.partitions = 4
			teds := f.runOnCluster(cc, minReplicas)
			if minReplicas > 0 {
				return
			}
			// The commands read the same deployment.
			cmd := func(args ...string) []byte {
				t.Helper()
				c := f.OutboxCmd("", args...)
				c.Env = append(c.Env, "REDIS_URL="+cluster.URL, "REDIS_CLUSTER=true", "OUTBOX_PARTITIONS=4")
				out, err := c.Output()
				if err != nil {
					t.Fatalf("outbox %v: %v\n%s", args, err, out)
				}
				return out
			}
			var st statusJSON
			if err := json.Unmarshal(cmd("status", "--json", "--stream", f.Stream(), "--key-prefix", f.keyPrefix()), &st); err != nil {
				t.Fatal(err)
			}
			if st.StreamLength != int64(len(teds)) || st.GroupPending != 0 || st.GroupLag != 0 || len(st.ByPartition) != 4 {
				t.Fatalf("status on the cluster: %+v", st)
			}
			var rep fraud.Report
			if err := json.Unmarshal(cmd("fraud", "report", "--json", "--key-prefix", f.keyPrefix()), &rep); err != nil || rep.Verdicts != int64(len(teds)) {
				t.Fatalf("fraud report on the cluster: %+v (err %v)", rep, err)
			}
			if out := string(cmd("fraud", "dlq", "list", "--key-prefix", f.keyPrefix())); out != "no dead letters in the 4 partitions' dead-letter streams\n" {
				t.Fatalf("fraud dlq list on the cluster: %q", out)
			}
			// reconcile: nothing differs; then one sender's total is changed
			// behind anti-fraud's back, and it is that sender it reports.
			var rec reconcile.Report
			if err := json.Unmarshal(cmd("reconcile", "--json", "--grace", "0s", "--stream", f.Stream(), "--key-prefix", f.keyPrefix()), &rec); err != nil {
				t.Fatal(err)
			}
			if !rec.OK || rec.Transfers != len(teds) || rec.Events != len(teds) || rec.Senders != 20 {
				t.Fatalf("reconcile on the cluster: %+v", rec)
			}
			var settledAt time.Time
			if err := f.Pool.QueryRow(f.Ctx, "SELECT settled_at FROM transfers WHERE from_account = 'acct-07' LIMIT 1").Scan(&settledAt); err != nil {
				t.Fatal(err)
			}
			day, _ := fraud.Day(settledAt)
			if err := cc.HIncrBy(f.Ctx, f.keys().Sender("acct-07").DayAccount(day, "acct-07"), "sent_cents", 1).Err(); err != nil {
				t.Fatal(err)
			}
			c := f.OutboxCmd("", "reconcile", "--json", "--grace", "0s", "--stream", f.Stream(), "--key-prefix", f.keyPrefix())
			c.Env = append(c.Env, "REDIS_URL="+cluster.URL, "REDIS_CLUSTER=true", "OUTBOX_PARTITIONS=4")
			out, err := c.Output()
			if err == nil || json.Unmarshal(out, &rec) != nil || rec.OK || rec.TotalsDiffer != 1 || rec.SenderDiffs[0].Account != "acct-07" {
				t.Fatalf("reconcile with acct-07's total changed: %v %s", err, out)
			}

			// The demo runs on the cluster too (its keys under a prefix of
			// its own, removed afterwards; a database of its own, where no
			// relay of this test publishes its events elsewhere).
			demo := f.OutboxCmd("", "demo", "--short")
			demo.Env = append(demo.Env, "REDIS_URL="+cluster.URL, "REDIS_CLUSTER=true", "DATABASE_URL="+outboxtest.PostgresURL(t))
			if out, err := relaytest.RunWithTimeout(demo, 2*time.Minute); err != nil || !strings.Contains(string(out), "checks passed, 0 failed") {
				t.Fatalf("outbox demo on the cluster: %v\n%s", err, out)
			}
		})
	}

	// One node that evicts, a replica (a master after a failover), is
	// enough for the relays and consumers to refuse the cluster.
	t.Run("an evicting replica is refused", func(t *testing.T) {
		f := newFixture(t)
		replica := cluster.Nodes[len(cluster.Nodes)-1]
		opt, err := redis.ParseURL(replica.URL)
		if err != nil {
			t.Fatal(err)
		}
		node := redis.NewClient(opt)
		defer node.Close()
		if err := node.ConfigSet(f.Ctx, "maxmemory-policy", "allkeys-lru").Err(); err != nil {
			t.Fatal(err)
		}
		defer node.ConfigSet(context.WithoutCancel(f.Ctx), "maxmemory-policy", "noeviction") //nolint:errcheck // the cluster ends with the test
		ctx, cancel := context.WithTimeout(f.Ctx, 20*time.Second)
		defer cancel()
		r := f.NewRelayOn(f.RelayConfig("r1"), f.RedisBroker(cc, redisbroker.Config{}))
		if err := r.Run(ctx); !errors.Is(err, redisbroker.ErrEvictingRedis) || !strings.Contains(err.Error(), opt.Addr+" allkeys-lru") {
			t.Fatalf("relay.Run on a cluster with an evicting replica: %v, want ErrEvictingRedis naming %s", err, opt.Addr)
		}
		c, err := fraud.New(cc, fraud.Config{Config: consumer.Config{Stream: f.Stream(), KeyPrefix: f.keyPrefix(), Consumer: "c1", Partitions: 4}})
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Run(ctx); !errors.Is(err, consumer.ErrEvictingRedis) {
			t.Fatalf("fraud Run on a cluster with an evicting replica: %v, want ErrEvictingRedis", err)
		}
	})
}

// runOnCluster settles 200 TEDs of 20 senders while a relay and two
// consumers run on the cluster with f.partitions partitions, and checks
// that every TED was judged once, each sender's in commit order, with the
// partitions spread over the masters.
func (f *fixture) runOnCluster(cc *redis.ClusterClient, minReplicas int) []transfer.Transfer {
	t := f.T
	t.Helper()
	rcfg := f.RelayConfig("r1")
	rcfg.Partitions = f.partitions
	r := f.NewRelayOn(rcfg, f.RedisBroker(cc, redisbroker.Config{MinReplicas: minReplicas}))
	f.Run(r.Run)
	var (
		mu      sync.Mutex
		applied = map[string][]string{} // sender -> transfer ids, in the order applied
	)
	for _, name := range []string{"c1", "c2"} {
		c, err := fraud.New(cc, fraud.Config{Config: consumer.Config{Stream: f.Stream(), KeyPrefix: f.keyPrefix(), Consumer: name, Partitions: f.partitions, Block: 100 * time.Millisecond, PartitionLease: 2 * time.Second}, MinReplicas: minReplicas, Observer: fraud.ObserverFunc(func(ev fraud.Event, o fraud.Outcome) {
			if o != fraud.OutcomeDuplicate {
				mu.Lock()
				applied[ev.FromAccount] = append(applied[ev.FromAccount], ev.TransferID.String())
				mu.Unlock()
			}
		})})
		if err != nil {
			t.Fatal(err)
		}
		f.Run(c.Run)
	}

	teds := make([]transfer.Transfer, 200)
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < len(teds); i += 4 {
				teds[i] = transfer.Transfer{ID: uuid.New(), FromAccount: fmt.Sprintf("acct-%02d", i%20), ToAccount: "acct-99", AmountCents: int64(100 + i)}
				if _, err := transfer.Settle(f.Ctx, f.Pool, teds[i]); err != nil {
					t.Error(err)
				}
			}
		}()
	}
	wg.Wait()
	keys := f.keys()
	outboxtest.Eventually(t, 30*time.Second, func() bool {
		rep, err := fraud.ReadReport(f.Ctx, cc, keys)
		return err == nil && rep.Verdicts == int64(len(teds))
	}, "not every TED judged on the cluster")

	rep, err := fraud.ReadReport(f.Ctx, cc, keys)
	if err != nil {
		t.Fatal(err)
	}
	want := senderTotals(teds)
	if fmt.Sprint(rep.Accounts) != fmt.Sprint(want) || rep.Verdicts != int64(len(teds)) {
		t.Fatalf("report on the cluster: %d verdicts, totals %v; want %d, %v", rep.Verdicts, rep.Accounts, len(teds), want)
	}
	ids := make([]string, len(teds))
	for i, ted := range teds {
		ids[i] = ted.ID.String()
	}
	verdicts, err := fraud.ReadVerdicts(f.Ctx, cc, keys, ids)
	if err != nil || slices.Contains(verdicts, "") {
		t.Fatalf("verdicts on the cluster: %v (err %v)", verdicts, err)
	}

	// Each sender's TEDs were applied in commit (seq) order.
	rows, err := f.Pool.Query(f.Ctx, "SELECT aggregate_id FROM outbox_messages ORDER BY seq")
	if err != nil {
		t.Fatal(err)
	}
	order, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	for sender, got := range applied {
		var committed []string
		for _, id := range order {
			if slices.Contains(got, id) {
				committed = append(committed, id)
			}
		}
		if !slices.Equal(got, committed) {
			t.Fatalf("sender %s: applied %v, committed %v", sender, got, committed)
		}
	}

	// The partitions are spread over the masters.
	masters := map[string]bool{}
	for _, s := range partition.Streams(f.Stream(), f.partitions) {
		node, err := cc.MasterForKey(f.Ctx, s)
		if err != nil {
			t.Fatal(err)
		}
		masters[node.Options().Addr] = true
	}
	if len(masters) < 3 {
		t.Fatalf("%d partitions on %d of the 3 masters", f.partitions, len(masters))
	}
	return teds
}
