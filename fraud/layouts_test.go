package fraud

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/internal/outboxtest"
	"github.com/tedbank/outbox/partition"
)

// An event applied under P = 1 is published again after
// the documented switch to P = 4 (a relay killed between its XADD and its
// mark; the reaped row goes to the new layout's stream). Its marker lives
// under the old layout's prefix; it must still be found, and the event
// skipped as a duplicate, not applied a second time.
func TestEventAppliedBeforeAChangeOfPartitionsIsNotAppliedAgain(t *testing.T) {
	d := newDeliveries(t)
	entries := d.publish(1)
	ev := d.events[0]

	ctx, cancel := context.WithCancel(d.ctx)
	before := newGroupConsumer(t, d.rdb, Config{Config: consumer.Config{Stream: d.stream, KeyPrefix: d.prefix, Consumer: "c1", Block: 100 * time.Millisecond}})
	done := make(chan error, 1)
	go func() { done <- before.Run(ctx) }()
	outboxtest.Eventually(t, 10*time.Second, func() bool { return d.report().Verdicts == 1 }, "the event was not applied under P = 1")
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	// The switch: consumers with --partitions 4; the event comes again, in
	// its sender's partition stream.
	p := partition.Of(ev.FromAccount, 4)
	if err := d.rdb.XAdd(d.ctx, &redis.XAddArgs{Stream: partition.Stream(d.stream, p, 4), Values: entries[0]}).Err(); err != nil {
		t.Fatal(err)
	}
	d.run("c1", func(c *Config) { c.Partitions = 4 })
	after := func() Report {
		rep, err := ReadReport(d.ctx, d.rdb.Client, Keys{Prefix: d.prefix, Partitions: 4})
		if err != nil {
			t.Fatal(err)
		}
		return rep
	}
	outboxtest.Eventually(t, 10*time.Second, func() bool { rep := after(); return rep.Verdicts+rep.DuplicatesSkipped == 1 },
		"the re-published event was not handled under P = 4")
	if rep := after(); rep.Verdicts != 0 || rep.DuplicatesSkipped != 1 {
		t.Fatalf("under P = 4: %d verdicts, %d duplicates skipped; want the event skipped as a duplicate (applied under P = 1)",
			rep.Verdicts, rep.DuplicatesSkipped)
	}
}
