package console

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/tedbank/outbox/internal/status"
)

// The guard: the token on every /api/ request, a POST that only the page
// can send, and requests addressed to a loopback name only.
func TestGuard(t *testing.T) {
	down := func(context.Context) status.Servers {
		err := errors.New("not reachable in this test")
		return status.Servers{PostgresErr: err, RedisErr: err}
	}
	h := Handler(Config{Status: status.Options{Stream: "s", Group: "g", KeyPrefix: "g:"}, Open: down, Token: "s3cret", Loopback: true})
	for _, c := range []struct {
		name, method, path, host, token, body string
		headers                               map[string]string
		want                                  int
	}{
		{"the page needs no token", "GET", "/", "127.0.0.1:9480", "", "", nil, 200},
		{"the script", "GET", "/console.js", "localhost:9480", "", "", nil, 200},
		{"no token", "GET", "/api/state", "127.0.0.1:9480", "", "", nil, 401},
		{"a wrong token", "GET", "/api/state", "127.0.0.1:9480", "guess", "", nil, 401},
		{"the token", "GET", "/api/state", "127.0.0.1:9480", "s3cret", "", nil, 200},
		{"another host name (DNS rebinding)", "GET", "/api/state", "evil.example:9480", "s3cret", "", nil, 421},
		{"a POST without the console's header", "POST", "/api/dead/retry", "[::1]:9480", "s3cret", `{}`,
			map[string]string{"Content-Type": "application/json"}, 403},
		{"a form POST", "POST", "/api/dead/retry", "127.0.0.1:9480", "s3cret", `event_id=x`,
			map[string]string{"Content-Type": "application/x-www-form-urlencoded", "X-Outbox-Console": "1"}, 403},
		{"no who and why", "POST", "/api/dead/retry", "127.0.0.1:9480", "s3cret", `{"event_id":"7b0c6c2e-0000-4000-8000-000000000001"}`,
			map[string]string{"Content-Type": "application/json", "X-Outbox-Console": "1"}, 400},
		{"not an event id", "POST", "/api/dead/retry", "127.0.0.1:9480", "s3cret", `{"event_id":"x","actor":"a","reason":"r"}`,
			map[string]string{"Content-Type": "application/json", "X-Outbox-Console": "1"}, 400},
		{"PostgreSQL down", "POST", "/api/dead/retry", "127.0.0.1:9480", "s3cret", `{"event_id":"7b0c6c2e-0000-4000-8000-000000000001","actor":"a","reason":"r"}`,
			map[string]string{"Content-Type": "application/json", "X-Outbox-Console": "1"}, 503},
	} {
		r := httptest.NewRequest(c.method, c.path, strings.NewReader(c.body))
		r.Host = c.host
		if c.token != "" {
			r.Header.Set("Authorization", "Bearer "+c.token)
		}
		for k, v := range c.headers {
			r.Header.Set(k, v)
		}
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if w.Code != c.want {
			t.Errorf("%s: %d %s, want %d", c.name, w.Code, w.Body.String(), c.want)
		}
	}
	// What a state read while both servers are down says.
	r := httptest.NewRequest("GET", "/api/state", nil)
	r.Host = "127.0.0.1"
	r.Header.Set("Authorization", "Bearer s3cret")
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	if !strings.Contains(w.Body.String(), `"healthy":false`) || !strings.Contains(w.Body.String(), "PostgreSQL could not be read: not reachable in this test") {
		t.Errorf("state with the servers down: %s", w.Body.String())
	}
	if got := w.Header().Get("Content-Security-Policy"); !strings.Contains(got, "default-src 'self'") {
		t.Errorf("Content-Security-Policy %q", got)
	}
}

// Without a token, a console bound to loopback answers.
func TestNoTokenOnLoopback(t *testing.T) {
	h := Handler(Config{Open: func(context.Context) status.Servers { return status.Servers{} }, Loopback: true,
		Status: status.Options{Stream: "s", Group: "g", KeyPrefix: "g:"}})
	r := httptest.NewRequest("GET", "/api/state", nil)
	r.Host = "localhost:9480"
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	if w.Code != http.StatusOK {
		t.Fatalf("%d %s", w.Code, w.Body.String())
	}
}
