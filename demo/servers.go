package demo

import (
	"context"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/consumer"
	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/tcpproxy"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/relay/redisbroker"
	"github.com/tedbank/outbox/transfer"
)

// setUp starts the proxies, the consumer and the demo's own listener.
func (d *demo) setUp(ctx context.Context) error {
	if err := d.Pool.QueryRow(ctx, "SELECT now()").Scan(&d.started); err != nil {
		return fmt.Errorf("read the database's clock: %w", err)
	}
	if err := d.ensureLedgerGroup(ctx); err != nil {
		return err
	}
	var err error
	if d.viaProxy, err = d.dialViaProxies(ctx); err != nil {
		return err
	}

	listenCfg := d.Pool.Config().ConnConfig.Copy()
	listenCfg.RuntimeParams["application_name"] = "outbox-demo-observer"
	if d.listen, err = pgx.ConnectConfig(ctx, listenCfg); err != nil {
		return fmt.Errorf("connect observer: %w", err)
	}
	if _, err := d.listen.Exec(ctx, "LISTEN "+relay.DefaultChannel); err != nil {
		return fmt.Errorf("listen: %w", err)
	}

	cons, err := fraud.New(d.viaProxy, fraud.Config{
		Config: consumer.Config{
			Stream: d.StreamPrefix + transfer.AggregateType, KeyPrefix: d.KeyPrefix, Consumer: "demo-fraud",
			Partitions: d.Partitions, PartitionLease: 2 * time.Second,
			Block: 200 * time.Millisecond, ClaimInterval: time.Second, Logger: d.Logger,
		},
		Observer: fraud.ObserverFunc(func(ev fraud.Event, o fraud.Outcome) {
			if o != fraud.OutcomeDuplicate {
				d.tl.mark(ev.EventID, stepVerdict, o.String())
			}
		}),
	})
	if err != nil {
		return err
	}
	if err := cons.EnsureGroup(ctx); err != nil {
		return err
	}
	bg, cancel := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	wg.Go(func() { _ = cons.Run(bg) })
	wg.Go(func() { d.observeNotifications(bg) })
	d.stopBg = func() { cancel(); wg.Wait() }
	return nil
}

func (d *demo) tearDown() {
	if d.relay != nil {
		d.relay.stop()
	}
	if d.stopBg != nil {
		d.stopBg()
	}
	if d.listen != nil {
		_ = d.listen.Close(context.Background())
	}
	if d.viaProxy != nil {
		_ = d.viaProxy.Close()
	}
	for _, p := range d.proxies {
		_ = p.Close()
	}
}

// dialViaProxies starts a TCP proxy in front of Redis (of each node of a
// cluster: a cluster client connects to the nodes the cluster names) and
// returns a client that reaches Redis only through them, so that scenario 4
// can cut Redis off.
func (d *demo) dialViaProxies(ctx context.Context) (redis.UniversalClient, error) {
	if !d.Cluster {
		opt, err := redis.ParseURL(d.RedisURL)
		if err != nil {
			return nil, fmt.Errorf("redis URL: %w", err)
		}
		p, err := tcpproxy.Start(opt.Addr)
		if err != nil {
			return nil, fmt.Errorf("start proxy: %w", err)
		}
		d.proxies = append(d.proxies, p)
		opt.Addr = p.Addr()
		opt.ClientName = "outbox-demo-via-proxy"
		opt.MaxRetries = -1
		opt.ContextTimeoutEnabled = true
		return redis.NewClient(opt), nil
	}
	opt, err := redis.ParseClusterURL(d.RedisURL)
	if err != nil {
		return nil, fmt.Errorf("redis cluster URL: %w", err)
	}
	slots, err := d.Redis.ClusterSlots(ctx).Result()
	if err != nil {
		return nil, fmt.Errorf("list the cluster's nodes: %w", err)
	}
	via := map[string]string{} // node address -> its proxy's
	for _, s := range slots {
		for _, n := range s.Nodes {
			if _, ok := via[n.Addr]; ok {
				continue
			}
			p, err := tcpproxy.Start(n.Addr)
			if err != nil {
				return nil, fmt.Errorf("start proxy: %w", err)
			}
			d.proxies = append(d.proxies, p)
			via[n.Addr] = p.Addr()
		}
	}
	var dialer net.Dialer
	opt.Dialer = func(ctx context.Context, network, addr string) (net.Conn, error) {
		if p, ok := via[addr]; ok {
			addr = p
		}
		return dialer.DialContext(ctx, network, addr)
	}
	opt.ClientName = "outbox-demo-via-proxy"
	opt.MaxRetries = -1
	opt.ContextTimeoutEnabled = true
	return redis.NewClusterClient(opt), nil
}

// redisReachable restores every proxy (up) or cuts them.
func (d *demo) redisReachable(up bool) {
	for _, p := range d.proxies {
		if up {
			p.Up()
		} else {
			p.Down()
		}
	}
}

func (d *demo) observeNotifications(ctx context.Context) {
	for ctx.Err() == nil {
		if _, err := d.listen.WaitForNotification(ctx); err != nil {
			return
		}
		d.tl.notified(time.Now())
	}
}

// runningRelay is an in-process relay started by the demo.
type runningRelay struct {
	*relay.Relay
	stop func()
}

func (d *demo) startRelay(name string, lease time.Duration) (*runningRelay, error) {
	// The demo walks the card's path: row claims under a lease, and the
	// reaper (scenario 2); the default ownership would lease partitions on
	// the demo's fresh database.
	b, err := redisbroker.New(d.viaProxy, redisbroker.Config{Logger: d.Logger})
	if err != nil {
		return nil, err
	}
	rl, err := relay.New(d.Pool, b, relay.Config{
		Name: name, StreamPrefix: d.StreamPrefix, Lease: lease, ReapInterval: lease / 8, Partitions: d.Partitions,
		Ownership: relay.OwnRows, Logger: d.Logger,
		Observer: relay.Hooks{
			OnClaim:   func(ids []uuid.UUID) { d.tl.markAll(ids, stepClaimed) },
			OnPublish: func(ids []uuid.UUID) { d.tl.markAll(ids, stepPublished) },
		},
	})
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = rl.Run(ctx) }()
	for range 500 { // LISTEN is up within milliseconds; the poll would catch up anyway
		if rl.Stats().ListenUp {
			break
		}
		time.Sleep(2 * time.Millisecond)
	}
	return &runningRelay{Relay: rl, stop: func() { cancel(); <-done }}, nil
}
