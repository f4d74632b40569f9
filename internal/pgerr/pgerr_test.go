package pgerr

import (
	"context"
	"fmt"
	"io"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

func TestConnLost(t *testing.T) {
	for _, c := range []struct {
		name string
		err  error
		want bool
	}{
		{"nil", nil, false},
		{"terminated backend", fmt.Errorf("claim: %w", &pgconn.PgError{Severity: "FATAL", Code: "57P01"}), true},
		{"idle session timeout", &pgconn.PgError{Severity: "FATAL", Code: "57P05"}, true},
		{"terminated, lc_messages pt_BR", &pgconn.PgError{Severity: "FATAL (pt)", SeverityUnlocalized: "FATAL", Code: "57P01"}, true},
		{"too many connections", &pgconn.PgError{Severity: "FATAL", Code: "53300"}, false},
		{"bad password", &pgconn.PgError{Severity: "FATAL", Code: "28P01"}, false},
		{"starting up", &pgconn.PgError{Severity: "FATAL", Code: "57P03"}, false},
		{"statement error", &pgconn.PgError{Severity: "ERROR", Code: "23505"}, false},
		{"serialization failure", &pgconn.PgError{Severity: "ERROR", Code: "40001"}, false},
		{"socket closed", fmt.Errorf("read: %w", io.ErrUnexpectedEOF), true},
		{"cancelled", fmt.Errorf("claim: %w", context.Canceled), false},
		{"deadline", context.DeadlineExceeded, false},
	} {
		if got := ConnLost(c.err); got != c.want {
			t.Errorf("%s: ConnLost(%v) = %v, want %v", c.name, c.err, got, c.want)
		}
	}
}

func TestTimedOut(t *testing.T) {
	for _, c := range []struct {
		name string
		err  error
		want bool
	}{
		{"nil", nil, false},
		{"deadline", fmt.Errorf("claim: %w", context.DeadlineExceeded), true},
		{"cancelled", fmt.Errorf("claim: %w", context.Canceled), false},
		{"terminated backend", &pgconn.PgError{Severity: "FATAL", Code: "57P01"}, false},
		{"statement timeout (the server's)", &pgconn.PgError{Severity: "ERROR", Code: "57014"}, false},
	} {
		if got := TimedOut(c.err); got != c.want {
			t.Errorf("%s: TimedOut(%v) = %v, want %v", c.name, c.err, got, c.want)
		}
	}
}

func TestDeadlocked(t *testing.T) {
	for _, c := range []struct {
		name string
		err  error
		want bool
	}{
		{"nil", nil, false},
		{"deadlock", fmt.Errorf("mark 10 rows published: %w", &pgconn.PgError{Severity: "ERROR", Code: "40P01"}), true},
		{"serialization failure", &pgconn.PgError{Severity: "ERROR", Code: "40001"}, false},
		{"terminated backend", &pgconn.PgError{Severity: "FATAL", Code: "57P01"}, false},
		{"socket closed", io.ErrUnexpectedEOF, false},
	} {
		if got := Deadlocked(c.err); got != c.want {
			t.Errorf("%s: Deadlocked(%v) = %v, want %v", c.name, c.err, got, c.want)
		}
	}
}
