package chaos

// Faults of what the data does rather than of a process or a link (issue
// 38): a burst of big payloads from a SQL writer, a long transaction that
// holds PostgreSQL's horizon while a backlog drains, and a Redis that comes
// back without its last seconds, repaired as an operator would.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"time"
)

const (
	// blobAggregate is the aggregate type of the big payloads' events: no
	// consumer reads their stream; verify checks that each was published.
	blobAggregate = "chaos-blob"
	// blobCount events of blobBytes each, 18 MiB in all: more than a
	// relay's byte budget per batch (relay.DefaultBatchBytes, 16 MiB),
	// and each under NATS's default message limit (1 MiB).
	blobCount = 24
	blobBytes = 768 << 10
)

// bigPayloads writes blobCount events of blobBytes each in one transaction,
// as a SQL writer would (no outbox.Write), each of its own key. The TEDs
// that commit meanwhile must not wait for them (relay_read.sql: smallest
// first within the byte budget).
func (r *run) bigPayloads(ctx context.Context) string {
	r.mu.Lock()
	r.blobBursts++
	n := r.blobBursts
	r.mu.Unlock()
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	// md5 (32 characters) repeated: a payload PostgreSQL cannot compress
	// much, as a real document.
	tag, err := r.mon.Exec(cctx, `INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload, partition_key)
		SELECT $1, 'blob-' || $2::int || '-' || g, 'blob.written',
		       jsonb_build_object('blob', repeat(md5(g::text || $2::text), $3::int / 32)), 'blob-' || $2::int || '-' || g
		  FROM generate_series(1, $4::int) g`, blobAggregate, n, blobBytes, blobCount)
	if err != nil {
		r.problem("big payloads: %v", err)
		return "insert failed: " + err.Error()
	}
	return fmt.Sprintf("%d events of %d KiB (%d MiB) written by a SQL writer in one transaction",
		tag.RowsAffected(), blobBytes>>10, blobCount*blobBytes>>20)
}

// longTransaction opens a transaction that holds PostgreSQL's horizon (it
// has an xid, so every row version deleted after it started stays), stops
// every relay for d to grow a backlog (SIGSTOP, connections open), continues
// them, and keeps the transaction open while the backlog drains (the
// recovery is measured meanwhile), ending it once the backlog is empty, or
// after 30 s.
func (r *run) longTransaction(ctx context.Context, d time.Duration) string {
	conn, err := r.mon.Acquire(ctx)
	if err != nil {
		r.problem("long transaction: %v", err)
		return "no connection: " + err.Error()
	}
	tx, err := conn.Begin(ctx)
	var xid int64
	if err == nil {
		err = tx.QueryRow(ctx, "SELECT txid_current()").Scan(&xid)
	}
	if err != nil {
		conn.Release()
		r.problem("long transaction: %v", err)
		return "begin failed: " + err.Error()
	}
	var stopped []*proc
	for _, p := range r.relays {
		if p.stop() {
			stopped = append(stopped, p)
		}
	}
	time.Sleep(d)
	for _, p := range stopped {
		p.cont()
	}
	backlog, _ := r.backlog(ctx)
	held := time.Now()
	r.bg.Add(1)
	go func() {
		defer r.bg.Done()
		defer conn.Release()
		for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline) && ctx.Err() == nil; time.Sleep(100 * time.Millisecond) {
			if n, err := r.backlog(ctx); err == nil && n == 0 {
				break
			}
		}
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if err := tx.Commit(cctx); err != nil {
			r.problem("long transaction: commit: %v", err)
		}
		r.logf("long transaction %d ended after %s more, the backlog drained", xid, time.Since(held).Round(time.Millisecond))
	}()
	return fmt.Sprintf("transaction %d open (horizon held); %d relays SIGSTOPped for %s, then continued with %d events waiting; the transaction stays open until they are published",
		xid, len(stopped), d, backlog)
}

// redisLoss: Redis comes back without its last d of writes, as when it
// restarts from an append-only file that had not reached the disk, or fails
// over to a replica that had not received them. Stream entries of events
// PostgreSQL marked published are gone, with the consumers' effects and
// markers of the same seconds (the whole dataset goes back in time, as it
// does in those cases). The repair is the operator's runbook
// (docs/operations.md): stop the relays and the consumers (so that no later
// event of a key overtakes its lost ones), `outbox reconcile --list-lost`,
// `outbox republish --report`, start them. Each lost TED must then be judged
// once more (its effect was lost too) and no other twice. Single Redis only:
// a cluster's nodes would each go back to a different moment.
func (r *run) redisLoss(ctx context.Context, d time.Duration) (string, error) {
	dir := r.rds.Dir()
	aof, snap := filepath.Join(dir, "appendonlydir"), filepath.Join(dir, "appendonlydir.before")
	// No rewrite of the append-only file while it is copied (the restart
	// brings the server's settings back).
	if err := r.rdb.ConfigSet(ctx, "auto-aof-rewrite-percentage", "0").Err(); err != nil {
		return "", fmt.Errorf("CONFIG SET: %w", err)
	}
	// Nor one already under way: a copy taken while a rewrite swaps the
	// files could bring back a dataset that never existed.
	if err := r.waitNoAOFRewrite(ctx); err != nil {
		return "", err
	}
	_ = os.RemoveAll(snap)
	if err := exec.CommandContext(ctx, "cp", "-a", aof, snap).Run(); err != nil {
		return "", fmt.Errorf("copy the append-only file: %w", err)
	}
	time.Sleep(d)

	// The relays and the consumers stop (the runbook, docs/operations.md):
	// a consumer that read an entry just before the loss could apply it on
	// the Redis that lost it, before its key's earlier lost events are
	// republished (a .ci/run found a sender's TEDs judged out of order so,
	// and the entry gone from the stream with its effect applied).
	held := slices.Concat(r.relays, r.consumers, r.ledgers)
	var wg sync.WaitGroup
	for _, p := range held {
		wg.Go(func() {
			if _, err := p.hold(); err != nil {
				r.problem("redis-loss: stop %s: %v", p.name, err)
			}
		})
	}
	wg.Wait()
	defer func() {
		for _, p := range held {
			p.release()
		}
	}()
	if err := r.rds.Kill(); err != nil {
		return "", fmt.Errorf("kill redis: %w", err)
	}
	if err := os.RemoveAll(aof); err != nil {
		return "", err
	}
	if err := os.Rename(snap, aof); err != nil {
		return "", err
	}
	if err := r.rds.Start(ctx); err != nil {
		return "", fmt.Errorf("restart redis: %w", err)
	}

	report := filepath.Join(r.cfg.Dir, "reconcile-"+strconv.FormatInt(time.Now().UnixMilli(), 10)+".json")
	out, err := r.outbox(ctx, "reconcile", "--database-url", r.dbURL, "--redis-url", r.rds.URL,
		"--partitions", strconv.Itoa(r.parts), "--grace", "1ms", "--json", "--list-lost")
	var rec struct {
		Lost []json.RawMessage `json:"lost"`
	}
	if jerr := json.Unmarshal(out, &rec); jerr != nil {
		return "", fmt.Errorf("outbox reconcile: %v (%v)\n%s", err, jerr, out)
	}
	if err := os.WriteFile(report, out, 0o644); err != nil {
		return "", err
	}
	republished := 0
	if len(rec.Lost) > 0 {
		out, err := r.outbox(ctx, "republish", "--database-url", r.dbURL, "--report", report,
			"--reason", "chaos: redis-loss", "--by", "chaos", "--json")
		var res struct {
			Republished []string `json:"republished"`
		}
		if jerr := json.Unmarshal(out, &res); err != nil || jerr != nil {
			return "", fmt.Errorf("outbox republish: %v (%v)\n%s", err, jerr, out)
		}
		republished = len(res.Republished)
	}
	if republished != len(rec.Lost) {
		r.problem("redis-loss: reconcile found %d lost events, republish put back %d", len(rec.Lost), republished)
	}
	return fmt.Sprintf("redis back without its last %s (its append-only file from before), the relays and consumers stopped meanwhile; "+
		"reconcile found %d events lost, republished %d, relays and consumers started", d, len(rec.Lost), republished), nil
}

// waitNoAOFRewrite waits until Redis neither rewrites its append-only file
// nor has a rewrite scheduled.
func (r *run) waitNoAOFRewrite(ctx context.Context) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		busy := int64(0)
		for _, f := range []string{"aof_rewrite_in_progress", "aof_rewrite_scheduled"} {
			v, err := infoField(ctx, r, "persistence", f)
			if err != nil {
				return fmt.Errorf("redis INFO persistence: %w", err)
			}
			busy += v
		}
		if busy == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return errors.New("redis still rewrites its append-only file after 30s")
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// outbox runs the outbox binary once and returns its standard output; an
// exit status of 1 with output (reconcile's "found something") is not an
// error.
func (r *run) outbox(ctx context.Context, args ...string) ([]byte, error) {
	cctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	cmd := exec.CommandContext(cctx, r.cfg.Binary, args...)
	cmd.Env = cleanEnv()
	var stderr []byte
	out, err := cmd.Output()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		stderr = ee.Stderr
		if ee.ExitCode() == 1 && len(out) > 0 {
			err = nil
		}
	}
	if err != nil {
		return out, fmt.Errorf("outbox %s: %w: %s", args[0], err, stderr)
	}
	return out, nil
}
