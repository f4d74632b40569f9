package chaos

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// settleLoop runs `outbox settle` directly against PostgreSQL until the
// database holds cfg.N transfers. A settle process that fails (PostgreSQL
// stopped, its sessions terminated) exits non-zero; then the transfers that
// did commit are counted in the database, not in settle's summary (a commit
// whose acknowledgement was lost counts too), and settle is started again for
// the remainder.
func (r *run) settleLoop(ctx context.Context) {
	defer close(r.settleDone)
	logPath := filepath.Join(r.cfg.Dir, "settle.log")
	for ctx.Err() == nil {
		committed, err := r.committed(ctx)
		if err != nil {
			time.Sleep(250 * time.Millisecond)
			continue
		}
		remaining := r.cfg.N - committed
		if remaining <= 0 {
			if remaining < 0 {
				r.problem("%d transfers committed, more than the %d settled", committed, r.cfg.N)
			}
			r.logf("load done: %d transfers committed by %d settle runs", committed, r.settleRuns)
			return
		}
		r.settleRuns++
		log, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			r.problem("settle log: %v", err)
			return
		}
		fmt.Fprintf(log, "=== chaos: settle run #%d for %d TEDs (%d committed) at %s\n", r.settleRuns, remaining, committed, stamp(time.Now()))
		cmd := exec.CommandContext(ctx, r.cfg.Binary, "settle", "--database-url", r.dbURL,
			"--count", strconv.Itoa(remaining), "--rate", strconv.FormatFloat(r.cfg.Rate, 'f', -1, 64),
			"--concurrency", strconv.Itoa(r.cfg.Concurrency), "--json")
		cmd.Env = cleanEnv()
		cmd.Stdout, cmd.Stderr = log, log
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
		err = cmd.Run()
		fmt.Fprintf(log, "=== chaos: settle run #%d ended: %v\n", r.settleRuns, err)
		_ = log.Close()
		if err != nil {
			r.logf("settle run #%d failed (%v); counting what committed and settling the rest", r.settleRuns, err)
			time.Sleep(500 * time.Millisecond)
		}
	}
}

// committed counts the transfers in the database.
func (r *run) committed(ctx context.Context) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	var n int
	err := r.mon.QueryRow(ctx, "SELECT count(*) FROM transfers").Scan(&n)
	return n, err
}

// backlog is the number of TEDs committed in PostgreSQL that anti-fraud has
// not judged yet: transfers minus verdicts.
func (r *run) backlog(ctx context.Context) (int, error) {
	committed, err := r.committed(ctx)
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	verdicts, err := r.rdb.HLen(ctx, "fraud:verdicts").Result()
	if err != nil {
		return 0, err
	}
	return committed - int(verdicts), nil
}

// outboxCounts returns the outbox rows by status.
func (r *run) outboxCounts(ctx context.Context) (pending, publishing, published, dead int, err error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	err = r.mon.QueryRow(ctx, `SELECT count(*) FILTER (WHERE status = 'pending'), count(*) FILTER (WHERE status = 'publishing'),
		count(*) FILTER (WHERE status = 'published'), count(*) FILTER (WHERE status = 'dead') FROM outbox_messages`).
		Scan(&pending, &publishing, &published, &dead)
	return
}

// progress logs the state of the pipeline every few seconds.
func (r *run) progress(ctx context.Context) {
	t := time.NewTicker(5 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		committed, err1 := r.committed(ctx)
		backlog, err2 := r.backlog(ctx)
		pending, publishing, published, dead, err3 := r.outboxCounts(ctx)
		if err1 != nil || err2 != nil || err3 != nil {
			r.logf("progress: unavailable (%v %v %v)", err1, err2, err3)
			continue
		}
		r.logf("progress: committed %d, unjudged %d, outbox pending %d publishing %d published %d dead %d",
			committed, backlog, pending, publishing, published, dead)
	}
}

// monitorPool is the suite's own connection to the database, direct (not
// through the proxy) and named so that the pg-terminate fault spares it.
func monitorPool(ctx context.Context, dbURL string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = "chaos-monitor"
	cfg.ConnConfig.ConnectTimeout = time.Second
	cfg.MaxConns = 4
	return pgxpool.NewWithConfig(ctx, cfg)
}

func hostPort(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		return ""
	}
	return u.Host
}

func killGroup(pid int) error { return syscall.Kill(-pid, syscall.SIGKILL) }
