package cli

// 'outbox cleanup': deletes published events older than --older-than, in batches.

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/tedbank/outbox/admin"
	"github.com/tedbank/outbox/internal/connect"
)

// ageValue is a duration flag that also takes whole days ("7d").
type ageValue time.Duration

func (a *ageValue) String() string {
	if a == nil || *a == 0 {
		return ""
	}
	return time.Duration(*a).String()
}

func (a *ageValue) Set(s string) error {
	if days, ok := strings.CutSuffix(s, "d"); ok {
		n, err := strconv.Atoi(days)
		if err != nil || n < 0 || n > 100_000 {
			return fmt.Errorf("%q: want a duration such as 720h, 30m or 7d", s)
		}
		*a = ageValue(time.Duration(n) * 24 * time.Hour)
		return nil
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("%q: want a duration such as 720h, 30m or 7d", s)
	}
	*a = ageValue(d)
	return nil
}

func runCleanup(ctx context.Context, e *env, args []string) error {
	var c common
	var olderThan ageValue
	fs := e.flags("cleanup", &c)
	usageLine(fs, "outbox cleanup --older-than D [--batch N] [--json]")
	fs.Var(&olderThan, "older-than", "delete rows published longer ago than this `duration`, e.g. 7d or 36h (required)")
	batch := fs.Int("batch", admin.DefaultCleanupBatch, "rows deleted per statement (each its own short transaction)")
	asJSON := fs.Bool("json", false, "print the result as JSON")
	if err := e.parse(fs, args); err != nil {
		return err
	}
	log, err := c.logger(e.stderr)
	if err != nil {
		return err
	}
	switch {
	case !isSet(fs, "older-than"):
		return usagef("--older-than is required (e.g. --older-than 7d)")
	case time.Duration(olderThan) < time.Microsecond:
		return usagef("--older-than %s: must be positive", time.Duration(olderThan))
	case *batch <= 0 || *batch > 100_000:
		return usagef("--batch %d: must be between 1 and 100000", *batch)
	}
	pool, err := openOutbox(ctx, c.databaseURL, connect.PostgresOptions{AppName: "outbox-cleanup", MaxConns: 2})
	if err != nil {
		return err
	}
	defer pool.Close()
	start := time.Now()
	lastInfo := start
	res, err := admin.Cleanup(ctx, pool, admin.CleanupOptions{
		OlderThan: time.Duration(olderThan),
		BatchSize: *batch,
		OnBatch: func(r admin.CleanupResult) {
			// Every batch at debug; at info every 10 seconds, so that a
			// long cleanup is seen to progress.
			level := slog.LevelDebug
			if time.Since(lastInfo) >= cleanupProgressEvery {
				level, lastInfo = slog.LevelInfo, time.Now()
			}
			log.Log(ctx, level, "cleanup progress", slog.Int("batches", r.Batches), slog.Int64("deleted", r.Deleted),
				slog.Float64("rows_per_s", float64(r.Deleted)/max(time.Since(start).Seconds(), 1e-9)))
		},
	})
	if err != nil {
		if res.Deleted > 0 {
			fmt.Fprintf(e.stdout, "deleted %d published rows before stopping\n", res.Deleted)
		}
		return err
	}
	if *asJSON {
		return json.NewEncoder(e.stdout).Encode(struct {
			admin.CleanupResult
			OlderThanSeconds float64 `json:"older_than_seconds"`
			ElapsedMS        int64   `json:"elapsed_ms"`
		}{res, time.Duration(olderThan).Seconds(), time.Since(start).Milliseconds()})
	}
	fmt.Fprintf(e.stdout, "deleted %d published %s (published before %s, older than %s) in %d %s, %s\n",
		res.Deleted, plural(res.Deleted, "row", "rows"), res.Cutoff.UTC().Format(time.RFC3339), time.Duration(olderThan),
		res.Batches, plural(int64(res.Batches), "batch", "batches"), time.Since(start).Round(time.Millisecond))
	return nil
}
