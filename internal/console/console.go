// Package console is the operator's web console ('outbox console'): one
// page, its assets embedded (no build step, nothing from a CDN), that shows a
// deployment live (what 'outbox status' reads: package status) and requeues a
// dead event or a consumer's dead letter through the same code as 'outbox
// dead retry' and 'outbox dlq retry' (packages admin and admin/dlq), each
// with a confirmation and an audit record: who, when, why
// (outbox_operator_actions).
//
// It serves:
//
//	GET  /                 the page (and /console.js, /console.css)
//	GET  /api/state        the status, the dead letters and the last actions, as JSON
//	POST /api/dead/retry   {"event_id", "actor", "reason"}: requeue a dead event
//	POST /api/dlq/retry    {"id", "actor", "reason"}: put a dead letter back on its stream
//
// With a token, every /api/ request must carry it (Authorization: Bearer).
// A POST must be JSON and carry the header X-Outbox-Console, which a page of
// another site cannot send without the console's consent (it gives none), and
// a console bound to a loopback address answers only requests addressed to
// a loopback name (no DNS rebinding).
package console

import (
	"context"
	"crypto/subtle"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/tedbank/outbox/admin"
	"github.com/tedbank/outbox/admin/dlq"
	"github.com/tedbank/outbox/internal/status"
)

//go:embed assets
var assets embed.FS

// Config says what the console reads and how it is reached.
type Config struct {
	// Status says what to read (as 'outbox status' flags do).
	Status status.Options
	// Open returns the servers, opening (again) those that are not open:
	// the console keeps serving while a server is down, and says so.
	Open func(ctx context.Context) status.Servers
	// Token, when set, must come with every /api/ request.
	Token string
	// Loopback: the console listens on a loopback address only, and
	// answers only requests addressed to a loopback name.
	Loopback bool
	Logger   *slog.Logger
}

// Handler returns the console's HTTP handler.
func Handler(cfg Config) http.Handler {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	c := &console{cfg: cfg}
	static, _ := fs.Sub(assets, "assets")
	mux := http.NewServeMux()
	mux.Handle("GET /", http.FileServerFS(static))
	mux.HandleFunc("GET /api/state", c.state)
	mux.HandleFunc("POST /api/dead/retry", c.deadRetry)
	mux.HandleFunc("POST /api/dlq/retry", c.dlqRetry)
	return c.guard(mux)
}

type console struct{ cfg Config }

// guard checks the Host, the token and a POST's headers.
func (c *console) guard(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Content-Type-Options", "nosniff")
		w.Header().Set("Content-Security-Policy", "default-src 'self'; frame-ancestors 'none'")
		if c.cfg.Loopback && !loopbackHost(r.Host) {
			http.Error(w, "this console answers requests to localhost only", http.StatusMisdirectedRequest)
			return
		}
		if strings.HasPrefix(r.URL.Path, "/api/") {
			if c.cfg.Token != "" {
				got, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
				if subtle.ConstantTimeCompare([]byte(got), []byte(c.cfg.Token)) != 1 {
					writeJSON(w, http.StatusUnauthorized, errorBody("the console's token is missing or wrong: open the page as /#token=<token>"))
					return
				}
			}
			if r.Method == http.MethodPost && (r.Header.Get("X-Outbox-Console") == "" ||
				!strings.HasPrefix(r.Header.Get("Content-Type"), "application/json")) {
				writeJSON(w, http.StatusForbidden, errorBody("a change needs a JSON body and the X-Outbox-Console header"))
				return
			}
		}
		next.ServeHTTP(w, r)
	})
}

func loopbackHost(hostport string) bool {
	host, _, err := net.SplitHostPort(hostport)
	if err != nil {
		host = hostport
	}
	host = strings.Trim(host, "[]")
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// State is what GET /api/state returns.
type State struct {
	Status *status.Status `json:"status"`
	// DeadLetters are the group's consumers' dead letters, oldest first
	// (at most 50), and DeadLettersTotal how many there are.
	DeadLetters      []dlq.DeadLetter `json:"dead_letters"`
	DeadLettersTotal int64            `json:"dead_letters_total"`
	// Actions are the last operators' actions, newest first.
	Actions []admin.Action `json:"actions"`
	ReadAt  time.Time      `json:"read_at"`
	// Errors says what could not be read besides the status (the dead
	// letters, the actions): an empty list there is then not "none".
	Errors []string `json:"errors"`
}

func (c *console) state(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	defer cancel()
	srv := c.cfg.Open(ctx)
	st, _ := status.Read(ctx, c.cfg.Status, srv)
	out := State{Status: st, DeadLetters: []dlq.DeadLetter{}, Actions: []admin.Action{}, ReadAt: time.Now().UTC(), Errors: []string{}}
	if srv.Redis != nil {
		letters, total, err := dlq.ListPartitions(ctx, srv.Redis, c.cfg.Status.KeyPrefix, c.cfg.Status.Partitions, 50)
		if err != nil {
			out.Errors = append(out.Errors, "the dead letters could not be read: "+err.Error())
		} else {
			out.DeadLetters, out.DeadLettersTotal = letters, total
		}
	}
	if srv.Postgres != nil {
		if actions, err := admin.Actions(ctx, srv.Postgres, 20); err != nil {
			out.Errors = append(out.Errors, "the operators' actions could not be read: "+err.Error())
		} else {
			out.Actions = actions
		}
	}
	writeJSON(w, http.StatusOK, out)
}

// change is the body of a POST: what to requeue, who asks and why.
type change struct {
	EventID string `json:"event_id"`
	ID      string `json:"id"`
	Actor   string `json:"actor"`
	Reason  string `json:"reason"`
}

func readChange(w http.ResponseWriter, r *http.Request) (change, bool) {
	var ch change
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, 16<<10))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&ch); err != nil {
		writeJSON(w, http.StatusBadRequest, errorBody("the body is not the JSON this takes: "+err.Error()))
		return ch, false
	}
	ch.Actor, ch.Reason = strings.TrimSpace(ch.Actor), strings.TrimSpace(ch.Reason)
	if ch.Actor == "" || ch.Reason == "" {
		writeJSON(w, http.StatusBadRequest, errorBody("say who you are and why (actor and reason): the audit keeps both"))
		return ch, false
	}
	if len(ch.Actor) > 200 || len(ch.Reason) > 1000 {
		writeJSON(w, http.StatusBadRequest, errorBody("who: at most 200 characters; why: at most 1000"))
		return ch, false
	}
	return ch, true
}

// ChangeResult is what a POST returns when it changed something.
type ChangeResult struct {
	Outcome string       `json:"outcome"`
	Action  admin.Action `json:"action"`
	// AuditError: the change was made and its audit record could not be
	// written (the log has the action).
	AuditError string `json:"audit_error,omitempty"`
}

func (c *console) deadRetry(w http.ResponseWriter, r *http.Request) {
	ch, ok := readChange(w, r)
	if !ok {
		return
	}
	id, err := uuid.Parse(ch.EventID)
	if err != nil {
		writeJSON(w, http.StatusBadRequest, errorBody(fmt.Sprintf("event_id %q is not an event id (a UUID)", ch.EventID)))
		return
	}
	srv := c.cfg.Open(r.Context())
	if srv.Postgres == nil {
		writeJSON(w, http.StatusServiceUnavailable, errorBody(fmt.Sprintf("PostgreSQL: %v", srv.PostgresErr)))
		return
	}
	res, err := admin.RetryDead(r.Context(), srv.Postgres, []uuid.UUID{id})
	if err != nil {
		writeJSON(w, http.StatusInternalServerError, errorBody(err.Error()))
		return
	}
	if len(res.Requeued) == 0 {
		writeJSON(w, http.StatusConflict, errorBody("nothing requeued: "+res.Skipped[0].String()))
		return
	}
	c.record(w, r, srv, admin.Action{Kind: admin.ActionDeadRetry, Target: id.String(), Actor: ch.Actor, Reason: ch.Reason,
		Outcome: "requeued: pending again, attempts 0"})
}

func (c *console) dlqRetry(w http.ResponseWriter, r *http.Request) {
	ch, ok := readChange(w, r)
	if !ok {
		return
	}
	if !dlq.ValidEntryID(ch.ID) {
		writeJSON(w, http.StatusBadRequest, errorBody(fmt.Sprintf("id %q is not a dead letter's id (a stream entry id like 1700000000000-0)", ch.ID)))
		return
	}
	srv := c.cfg.Open(r.Context())
	if srv.Redis == nil || srv.Postgres == nil {
		writeJSON(w, http.StatusServiceUnavailable, errorBody(fmt.Sprintf("a retry needs Redis and, for its audit, PostgreSQL: %v", errors.Join(srv.RedisErr, srv.PostgresErr))))
		return
	}
	opts := c.cfg.Status
	res, err := dlq.RetryPartitions(r.Context(), srv.Redis, opts.KeyPrefix, opts.Partitions, []string{ch.ID}, false, opts.Stream)
	var done []string
	for _, d := range res.Retried {
		done = append(done, "re-added to "+d.Stream+" as "+d.NewID)
	}
	switch {
	case len(done) > 0:
		// Audited whatever else failed: it changed something.
		a := admin.Action{Kind: admin.ActionDLQRetry, Target: "dead letter " + ch.ID + " of the consumers under " + opts.KeyPrefix,
			Actor: ch.Actor, Reason: ch.Reason, Outcome: strings.Join(done, "; ")}
		if err != nil {
			a.Outcome += fmt.Sprintf(" (then: %v)", err)
		}
		c.record(w, r, srv, a)
		return
	case err != nil:
		writeJSON(w, http.StatusInternalServerError, errorBody(err.Error()))
		return
	case len(res.Failed) > 0:
		writeJSON(w, http.StatusConflict, errorBody(fmt.Sprintf("not retried: %v", res.Failed[0].Err)))
		return
	default:
		writeJSON(w, http.StatusNotFound, errorBody(fmt.Sprintf("no dead letter %s (retried already?)", ch.ID)))
	}
}

// record logs the change made and writes its audit record.
func (c *console) record(w http.ResponseWriter, r *http.Request, srv status.Servers, a admin.Action) {
	a.Origin = "console " + r.RemoteAddr
	c.cfg.Logger.Info("operator action", slog.String("action", a.Kind), slog.String("target", a.Target),
		slog.String("actor", a.Actor), slog.String("reason", a.Reason), slog.String("origin", a.Origin), slog.String("outcome", a.Outcome))
	res := ChangeResult{Outcome: a.Outcome, Action: a}
	// The change is made: its record is written even if the browser has
	// gone meanwhile.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), 10*time.Second)
	defer cancel()
	recorded, err := admin.Record(ctx, srv.Postgres, a)
	if err != nil {
		c.cfg.Logger.Error("the audit record of an operator action could not be written", slog.Any("error", err))
		res.AuditError = err.Error()
	} else {
		res.Action = recorded
	}
	writeJSON(w, http.StatusOK, res)
}

func errorBody(msg string) map[string]string { return map[string]string{"error": msg} }

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}
