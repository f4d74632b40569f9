package connect

import (
	"net/url"
	"strings"
	"testing"
	"unicode"
)

// Connection strings as users write them, valid or not; %s is the password
// as written there.
var secretTemplates = []struct {
	form, tmpl string
}{
	{"url", "redis://:%s@127.0.0.1:abc/15"}, // bad port: does not parse
	{"url", "redis://default:%s@127.0.0.1:6379/0"},
	{"url", "rediss://app:%s@[::1]:6380/2?dial_timeout=3s"},
	{"url", "postgres://u:%s@127.0.0.1:abc/db?sslmode=disable"},
	{"url", "postgresql://u:%s@db.internal:5432/outbox"},
	{"query", "postgres://127.0.0.1/db?sslmode=disable&password=%s"},
	{"query", "redis://127.0.0.1:6379/0?password=%s&protocol=3"},
	{"dsn", "host=127.0.0.1 port=abc user=u password=%s dbname=x"},
	{"dsn", "host=127.0.0.1 user=u password = %s"},
	{"dsnq", "host=127.0.0.1 user=u password='%s' dbname=x"},
}

// write renders password p the way form needs it written.
func write(form, p string) string {
	switch form {
	case "url":
		return url.UserPassword("u", p).String()[2:] // "u:" + escaped password
	case "query":
		return url.QueryEscape(p)
	case "dsnq":
		return strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(p)
	}
	return p
}

func checkRedacted(t *testing.T, p string) {
	t.Helper()
	for _, c := range secretTemplates {
		if c.form == "dsn" && (strings.ContainsAny(p, "'\\&;,\")`") || strings.IndexFunc(p, unicode.IsSpace) >= 0) {
			continue // a bare DSN value cannot hold these
		}
		written := write(c.form, p)
		raw := strings.Replace(c.tmpl, "%s", written, 1)
		rest := strings.Replace(c.tmpl, "%s", "", 1)
		// Text around the password, as error messages quote it.
		msg := `cannot parse "` + raw + `": invalid port; dial ` + raw + ": refused"
		outs := map[string]string{
			"Redact":        Redact(raw),
			"RedactSecrets": RedactSecrets(msg),
			"redactText":    redactText(msg, raw),
		}
		for name, out := range outs {
			for _, secret := range []string{written, p} {
				if len(secret) < 4 || strings.Contains(rest, secret) || strings.Contains("xxxxx", secret) {
					continue // too short to tell from the text around it
				}
				if strings.Contains(out, secret) {
					t.Errorf("%s(%q) leaks %q:\n%s", name, raw, secret, out)
				}
			}
		}
	}
}

func TestRedactSecrets(t *testing.T) {
	for _, p := range []string{"topsecret", "p@ss:w/rd?#x", "with space", "quo'te\\slash", "%41%42%43%44", "пароль-секрет"} {
		checkRedacted(t, p)
	}
	// What must survive: the rest of the message.
	got := RedactSecrets("cannot reach Redis at redis://:hunter22@127.0.0.1:abc/15: invalid port")
	if got != "cannot reach Redis at redis://:xxxxx@127.0.0.1:abc/15: invalid port" {
		t.Errorf("got %q", got)
	}
	got = RedactSecrets("bad URL host=h port=abc user=u password=hunter22: invalid port")
	if got != "bad URL host=h port=abc user=u password=xxxxx: invalid port" {
		t.Errorf("got %q", got)
	}
}

func FuzzRedactSecrets(f *testing.F) {
	for _, p := range []string{"topsecret", "p@ss:w/rd", "a b c d", "x'y\\z", "@@@@", "::::", "pass=word"} {
		f.Add(p)
	}
	f.Fuzz(func(t *testing.T, p string) {
		checkRedacted(t, p)
	})
}
