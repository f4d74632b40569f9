package connect

import (
	"errors"
	"strings"
	"testing"
)

func TestRedactHidesPasswords(t *testing.T) {
	for in, secret := range map[string]string{
		"postgres://app:hunter2@db:5432/x?sslmode=require": "hunter2",
		"postgres://db/x?user=app&password=hunter3":        "hunter3",
		"redis://:hunter4@cache:6379/0":                    "hunter4",
		"rediss://user:hunter5@cache:6380/1":               "hunter5",
		"host=db user=app password=hunter6":                "hunter6",
	} {
		if out := Redact(in); strings.Contains(out, secret) {
			t.Errorf("Redact(%q) = %q leaks the password", in, out)
		}
	}
	if got := redactErr(errors.New("auth failed for hunter2"), "postgres://a:hunter2@h/d"); strings.Contains(got, "hunter2") {
		t.Errorf("redactErr leaks: %q", got)
	}
}
