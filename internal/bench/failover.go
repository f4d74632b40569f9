package bench

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/internal/tcpproxy"
	"github.com/tedbank/outbox/relay"
	"github.com/tedbank/outbox/relay/redisbroker"
)

// Failover settles at rate per second for d with two relays of the given
// ownership sharing the outbox (the flow's relay and a second one, the
// victim) and kills the victim a third of the way in, right after it claimed
// (or read) a batch it has not published, without restarting it. It measures
// commit → stream entry of every TED: what the victim's death costs the
// events it held, and those of its slots.
//
// The victim reaches PostgreSQL and Redis through proxies of its own. To
// kill it, the Redis proxy goes silent first (its next publish hangs,
// holding its batch), and once it claimed rows both proxies close every
// connection and refuse new ones: the servers see what they see when a
// process is SIGKILLed (its sockets closed), and the victim can do nothing
// more.
func Failover(ctx context.Context, e Env, rate float64, d time.Duration) (Result, error) {
	if e.JS != nil {
		return Result{}, errors.New("failover: Redis Streams only (--broker redis)")
	}
	plain, ok := e.Redis.(*redis.Client)
	if !ok {
		return Result{}, errors.New("failover: one Redis server only, not a cluster")
	}
	s, err := e.open(ctx, "failover", 64)
	if err != nil {
		return Result{}, err
	}
	defer s.close()
	if err := s.warm(ctx, 16); err != nil {
		return Result{}, err
	}
	f, err := startFlow(ctx, e, s, true)
	if err != nil {
		return Result{}, err
	}
	defer f.stop()

	pgProxy, rdsProxy, victimPool, victimRedis, err := s.proxied(ctx, plain)
	if err != nil {
		return Result{}, err
	}
	defer pgProxy.Close()
	defer rdsProxy.Close()
	defer victimRedis.Close()
	victim, err := redisRelay(victimPool, victimRedis, relay.Config{Name: "victim", StreamPrefix: s.prefix, Logger: e.Log,
		Ownership: e.Ownership, Partitions: e.partitions(), BusyRows: e.BusyRows}, redisbroker.Config{})
	if err != nil {
		return Result{}, err
	}
	vctx, vcancel := context.WithCancel(ctx)
	defer vcancel()
	victimDone := make(chan struct{})
	go func() { defer close(victimDone); _ = victim.Run(vctx) }()
	for !victim.Stats().ListenUp {
		if err := ctx.Err(); err != nil {
			return Result{}, err
		}
		time.Sleep(time.Millisecond)
	}

	var killedAt time.Time
	var killErr error
	killed := make(chan struct{})
	go func() {
		defer close(killed)
		select {
		case <-ctx.Done():
			return
		case <-time.After(d / 3):
		}
		// Silence its Redis, wait for a claim it will hold, then cut
		// everything.
		before := victim.Stats().Claimed
		deadline := time.Now().Add(5 * time.Second)
		for victim.Stats().Claimed == before {
			rdsProxy.Freeze()
			if time.Now().After(deadline) {
				killErr = errors.New("failover: the victim claimed nothing in 5s")
				break
			}
			time.Sleep(time.Millisecond)
		}
		pgProxy.Down()
		rdsProxy.Down()
		killedAt = time.Now()
		vcancel()
	}()
	n := max(int(rate*d.Seconds()), 1)
	start := time.Now()
	lag, err := openLoop(ctx, rate, n, f.settle)
	if err != nil {
		return Result{}, err
	}
	took := time.Since(start)
	<-killed
	if killErr != nil {
		return Result{}, killErr
	}
	if err := f.wait(90 * time.Second); err != nil {
		return Result{}, err
	}
	<-victimDone
	toStream, _ := f.latencies()
	if len(toStream) == 0 {
		return Result{}, errNoEvents
	}
	settings := map[string]any{"rate": rate, "duration": d.String(), "relays": 2, "killed_after": killedAt.Sub(start).Round(time.Millisecond).String(),
		"ownership": f.relay.Ownership(), "lease": relay.DefaultLease.String(), "poll": f.relay.Config().PollInterval.String(),
		"broker": s.broker(), "partitions": e.partitions()}
	r := percentiles("failover_commit_to_stream", toStream, took, settings)
	r.OverOneS = overOneSecond(toStream)
	r.Errors = ptr(f.errs.Load())
	r.MaxScheduleLagMs = ptr(ms(lag))
	r.PollsWithWork = ptr(f.relay.Stats().PollsWithWork)
	return r, nil
}

// proxied opens a pool to the space's database and a Redis client, both
// through proxies of their own.
func (s *space) proxied(ctx context.Context, rdb *redis.Client) (pg, rds *tcpproxy.Proxy, pool *pgxpool.Pool, client *redis.Client, err error) {
	cfg, err := pgxpool.ParseConfig(s.dbURL)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	host := cfg.ConnConfig.Host
	if host == "" || host[0] == '/' {
		return nil, nil, nil, nil, fmt.Errorf("failover: PostgreSQL must be reached over TCP, not %q", host)
	}
	if pg, err = tcpproxy.Start(net.JoinHostPort(host, strconv.Itoa(int(cfg.ConnConfig.Port)))); err != nil {
		return nil, nil, nil, nil, err
	}
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = "127.0.0.1", uint16(pg.Port())
	for _, fb := range cfg.ConnConfig.Fallbacks {
		fb.Host, fb.Port = cfg.ConnConfig.Host, cfg.ConnConfig.Port
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = "outbox-bench-victim"
	cfg.MaxConns = 4
	if pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		_ = pg.Close()
		return nil, nil, nil, nil, err
	}
	s.extra = append(s.extra, pool)
	if rds, err = tcpproxy.Start(rdb.Options().Addr); err != nil {
		_ = pg.Close()
		return nil, nil, nil, nil, err
	}
	opt := *rdb.Options()
	opt.Addr = rds.Addr()
	opt.MaxRetries = -1
	return pg, rds, pool, redis.NewClient(&opt), nil
}
