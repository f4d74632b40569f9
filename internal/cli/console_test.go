package cli

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/tedbank/outbox/fraud"
	"github.com/tedbank/outbox/internal/outboxtest"
)

// chromium returns Debian's Chromium, or skips the test where it is not
// installed; in CI (CI set) it must be: .ci/run installs it.
func chromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser"} {
		if path, err := exec.LookPath(name); err == nil {
			return path
		}
	}
	if os.Getenv("CI") != "" {
		t.Fatal("chromium is not installed (apt-get install chromium): the console's browser test must run in CI")
	}
	t.Skip("chromium is not installed (apt-get install chromium)")
	return ""
}

// browser starts a headless Chromium for the test.
func browser(t *testing.T) context.Context {
	t.Helper()
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(chromium(t)), chromedp.NoSandbox,
		chromedp.Flag("disable-quic", true), chromedp.Flag("disable-component-update", true), chromedp.UserDataDir(t.TempDir()))
	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(alloc)
	ctx, cancelTimeout := context.WithTimeout(ctx, 90*time.Second)
	t.Cleanup(func() { cancelTimeout(); cancel(); cancelAlloc() })
	return ctx
}

// text is what the page shows in the element sel.
func text(t *testing.T, ctx context.Context, sel string) string {
	t.Helper()
	s, err := chromedp.Run(ctx, chromedp.Text(sel))
	if err != nil {
		t.Fatalf("read %s: %v", sel, err)
	}
	return s
}

// startConsole runs 'outbox console' on a free port and returns its URL.
func (d *deployment) startConsole(args ...string) string {
	d.t.Helper()
	out, stop := background(d.env, append([]string{"console", "--addr", "127.0.0.1:0", "--stream", d.stream(), "--key-prefix", d.keyPrefix()}, args...)...)
	d.t.Cleanup(func() {
		if code := stop(); code != exitOK {
			d.t.Errorf("console: exit %d\n%s", code, out.Bytes())
		}
	})
	re := regexp.MustCompile(`console on (http://127\.0\.0\.1:\d+/)`)
	var url string
	outboxtest.Eventually(d.t, 10*time.Second, func() bool {
		m := re.FindSubmatch(out.Bytes())
		if m != nil {
			url = string(m[1])
		}
		return m != nil
	}, "the console did not start:\n%s", out.Bytes())
	return url
}

// The console in a real browser: it shows a running deployment (its relay,
// its consumer, a dead event, a dead letter), and a dead event requeued
// through the page, with who and why, reaches anti-fraud once and is
// audited; a dead letter requeued through it goes back on its stream.
func TestConsoleInABrowser(t *testing.T) {
	ctx := browser(t)
	d := newDeployment(t)
	bg := context.Background()

	// A TED settled while nothing runs, whose event then went dead.
	if code, _, stderr := run(t, d.env, "settle", "--count", "1", "--json"); code != exitOK {
		t.Fatalf("settle: exit %d %s", code, stderr)
	}
	var eventID, transferID string
	if err := d.pool.QueryRow(bg, "SELECT id::text, aggregate_id FROM outbox_messages").Scan(&eventID, &transferID); err != nil {
		t.Fatal(err)
	}
	d.exec(`UPDATE outbox_messages SET status = 'dead', attempts = 10, last_error = 'WRONGTYPE Operation against a key holding the wrong kind of value' WHERE id = $1`, eventID)
	// A dead letter anti-fraud gave up on.
	letter, err := d.rdb.XAdd(bg, &redis.XAddArgs{Stream: d.keyPrefix() + "dlq", Values: []any{
		"event_id", "7b0c6c2e-0000-4000-8000-000000000001", "event_type", "transfer.settled", "payload", "{}",
		"dlq_stream", d.stream(), "dlq_group", "fraud", "dlq_entry_id", "1-0", "dlq_reason", "invalid event: payload {}: <nil>",
		"dlq_deliveries", "5", "dlq_consumer", "c1"}}).Result()
	if err != nil {
		t.Fatal(err)
	}
	d.startRelay("r1")
	d.start("fraud", "--stream", d.stream(), "--key-prefix", d.keyPrefix(), "--consumer", "c1")
	url := d.startConsole()

	err = chromedp.Do(ctx,
		chromedp.Navigate(url),
		chromedp.WaitVisible(`#relays tr[data-name="r1"]`),
		chromedp.WaitVisible(fmt.Sprintf(`#dead tr[data-event-id="%s"]`, eventID)),
		chromedp.WaitVisible(fmt.Sprintf(`#dead-letters tr[data-id="%s"]`, letter)),
		chromedp.Poll[chromedp.Void](`document.querySelector('[data-figure="live members"] dd').textContent === "1"`,
			chromedp.WithPollingTimeout(20*time.Second)),
	)
	if err != nil {
		t.Fatalf("the page did not show the deployment: %v", err)
	}
	verdict, relays, members := text(t, ctx, `#verdict`), text(t, ctx, `#relays tbody`), text(t, ctx, `[data-figure="members"] dd`)
	if verdict != "delivering" || !strings.Contains(relays, "alive") || members != "c1" {
		t.Fatalf("the page shows verdict %q, relays %q, members %q", verdict, relays, members)
	}
	if published := text(t, ctx, `[data-figure="published"] dd`); !strings.HasPrefix(published, "not counted") {
		t.Fatalf("the page counts the published rows (%q): a page left open must not scan the table", published)
	}

	// Requeue the dead event through the page.
	requeue := func(button string, who, why string) {
		t.Helper()
		err := chromedp.Do(ctx,
			chromedp.Click(button),
			chromedp.WaitVisible(`#confirm`),
			chromedp.Evaluate[chromedp.Void](`document.getElementById('confirm-actor').select()`), // the page keeps the last name given: type over it
			chromedp.SendKeys(`#confirm-actor`, who),
			chromedp.SendKeys(`#confirm-reason`, why),
			chromedp.Click(`#confirm-ok`),
			chromedp.WaitVisible(`#message`),
		)
		if err != nil {
			t.Fatalf("requeue through the page: %v", err)
		}
	}
	requeue(fmt.Sprintf(`#dead tr[data-event-id="%s"] button.requeue`, eventID), "ana", "the stream key was fixed")
	keys := fraud.Keys{Prefix: d.keyPrefix()}
	outboxtest.Eventually(t, 20*time.Second, func() bool {
		rep, err := fraud.ReadReport(bg, d.rdb.Client, keys)
		return err == nil && rep.Verdicts == 1
	}, "the requeued event did not reach anti-fraud")
	var who, why, action, target string
	if err := d.pool.QueryRow(bg, "SELECT actor, reason, action, target FROM outbox_operator_actions").Scan(&who, &why, &action, &target); err != nil {
		t.Fatalf("the audit record: %v", err)
	}
	if who != "ana" || why != "the stream key was fixed" || action != "dead_retry" || target != eventID {
		t.Fatalf("audit %q %q %q %q", who, why, action, target)
	}

	// Requeue the dead letter: back on its stream, gone from the dead letters.
	requeue(fmt.Sprintf(`#dead-letters tr[data-id="%s"] button.requeue`, letter), "bia", "replay after the decoder fix")
	outboxtest.Eventually(t, 10*time.Second, func() bool {
		left, err := d.rdb.XRange(bg, d.keyPrefix()+"dlq", letter, letter).Result()
		return err == nil && len(left) == 0
	}, "the dead letter is still in the dead-letter stream")
	var outcome string
	outboxtest.Eventually(t, 10*time.Second, func() bool { // written right after the retry
		err := d.pool.QueryRow(bg, "SELECT outcome FROM outbox_operator_actions WHERE action = 'dlq_retry' AND actor = 'bia'").Scan(&outcome)
		return err == nil
	}, "no audit record of the dead letter's retry: %v", func() any {
		rows, _ := d.pool.Query(bg, "SELECT actor, action, target, outcome FROM outbox_operator_actions")
		vals, _ := pgx.CollectRows(rows, pgx.RowToMap)
		return vals
	})
	if !strings.HasPrefix(outcome, "re-added to "+d.stream()+" as ") {
		t.Fatalf("dlq audit outcome %q", outcome)
	}
	err = chromedp.Do(ctx, chromedp.Poll[chromedp.Void](`document.querySelectorAll('#actions tbody tr').length === 2`,
		chromedp.WithPollingTimeout(10*time.Second)))
	if actions := text(t, ctx, `#actions tbody`); err != nil || !strings.Contains(actions, "ana") || !strings.Contains(actions, "bia") {
		t.Fatalf("the page's actions %q (err %v)", actions, err)
	}
	rep, err := fraud.ReadReport(bg, d.rdb.Client, keys)
	if err != nil || rep.Verdicts != 1 {
		t.Fatalf("anti-fraud's verdicts %d (err %v): the requeued event must be judged once", rep.Verdicts, err)
	}
}

// A console reachable from other machines needs a token.
func TestConsoleOffLoopbackNeedsAToken(t *testing.T) {
	code, _, stderr := run(t, nil, "console", "--addr", "0.0.0.0:0")
	if code != exitUsage || !strings.Contains(stderr, "--token") {
		t.Fatalf("exit %d %q, want a usage error asking for --token", code, stderr)
	}
}
