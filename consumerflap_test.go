package outbox_test

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/outboxtest"
)

// A lone consumer whose Redis connections (its pool's and its presence
// connection) are all killed every second, 12 times, while TEDs settle in a
// trickle and bursts (the same fault as the relay's in
// relay.TestRelayWhoseBackendsAreTerminatedAgainAndAgain, on the consumer's
// side): each incident starts from zero, and every TED is judged within
// flapBound of its commit, once, each sender's in order.
func TestConsumerWhoseRedisConnectionsAreKilledAgainAndAgain(t *testing.T) {
	const flapBound = 2 * time.Second // the bound is 1 s; slack for -race
	f := newFixture(t)
	f.Run(f.NewRelay(f.RelayConfig("relay"), nil).Run)
	opt, err := redis.ParseURL(f.Redis.URL)
	if err != nil {
		t.Fatal(err)
	}
	const name = "flapping-consumer"
	opt.ClientName = name
	rdb := redis.NewClient(opt)
	t.Cleanup(func() { _ = rdb.Close() })
	c, err := fraud.New(rdb, fraud.Config{Config: consumer.Config{Stream: f.Stream(), KeyPrefix: f.keyPrefix(), Consumer: "c1", Block: 100 * time.Millisecond}, AuditLen: 100_000})
	if err != nil {
		t.Fatal(err)
	}
	f.Run(c.Run)
	token := func() string {
		tok, _ := f.Redis.Get(f.Ctx, f.keys().Consumer("fraud", "c1")).Result()
		return tok
	}
	outboxtest.Eventually(t, 10*time.Second, func() bool { return token() != "" }, "the consumer did not start")

	committed, stopWrite, written := settleSteadily(t, f, 20*time.Millisecond)
	for i := range 12 {
		// This consumer's connections only: its pool's, by their client
		// name, and its presence connection, by its process token.
		list, err := f.Redis.ClientList(f.Ctx).Result()
		if err != nil {
			t.Fatal(err)
		}
		killed := 0
		for line := range strings.SplitSeq(list, "\n") {
			var id, cname string
			for field := range strings.FieldsSeq(line) {
				if v, ok := strings.CutPrefix(field, "id="); ok {
					id = v
				}
				if v, ok := strings.CutPrefix(field, "name="); ok {
					cname = v
				}
			}
			if id != "" && (cname == name || cname == "outbox-consumer-"+token()) {
				n, _ := strconv.ParseInt(id, 10, 64)
				if err := f.Redis.ClientKillByFilter(f.Ctx, "ID", strconv.FormatInt(n, 10)).Err(); err == nil {
					killed++
				}
			}
		}
		if killed == 0 {
			t.Fatalf("incident %d: no connection of the consumer to kill", i+1)
		}
		f.Settle(5) // a burst while it reconnects
		time.Sleep(time.Second)
	}
	close(stopWrite)
	<-written

	// Every TED settled, the bursts' too (committed has the trickle's only,
	// with their commit times): waiting for the trickle's count alone let
	// the check run before the last bursts' TEDs were judged.
	all, teds := committed(), f.settled()
	outboxtest.Eventually(t, 30*time.Second, func() bool { return f.report().Verdicts >= int64(len(teds)) },
		"not every TED was judged")
	f.checkEffectsOnce(teds)
	applied, bySender := auditTimes(f)
	var late []string
	var slowest time.Duration
	for id, at := range all {
		w := applied[id].Sub(at)
		slowest = max(slowest, w)
		if w > flapBound {
			late = append(late, fmt.Sprintf("%s after %s", id, w.Round(time.Millisecond)))
		}
	}
	t.Logf("%d TEDs over 12 incidents: commit to effect at most %s", len(all), slowest.Round(time.Millisecond))
	if len(late) > 0 {
		t.Errorf("%d of %d TEDs judged more than %s after their commit: %v", len(late), len(all), flapBound, late)
	}
	checkSendersOrder(t, f, bySender, "applied")
}
