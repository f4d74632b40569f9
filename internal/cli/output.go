package cli

// Helpers that format the admin commands' output.

import (
	"fmt"
	"io"
	"strings"
	"time"
	"unicode/utf8"
)

// cell makes s one line of at most n runes, for a table cell.
func cell(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	r := []rune(s)
	return string(r[:n-1]) + "…"
}

// cellEnds is cell for a message whose cause comes last (an error's
// reason): a long one keeps its start and its end, the middle cut.
func cellEnds(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	r := []rune(s)
	if len(r) <= n {
		return s
	}
	head := (n - 1) / 2
	return string(r[:head]) + "…" + string(r[len(r)-(n-1-head):])
}

func orDash(s string) string {
	if strings.TrimSpace(s) == "" {
		return "-"
	}
	return s
}

func plural(n int64, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

// list joins items with ", ", naming at most most of them.
func list(items []string, most int) string {
	if len(items) <= most {
		return strings.Join(items, ", ")
	}
	return strings.Join(items[:most], ", ") + fmt.Sprintf(" and %d more", len(items)-most)
}

// listFooter ends a listing: how many of how many dead things were shown.
func listFooter(w io.Writer, shown int, total int64, noun, limitFlag string) {
	if int64(shown) < total {
		fmt.Fprintf(w, "%d of %d dead %ss shown (%s)\n", shown, total, noun, limitFlag)
		return
	}
	fmt.Fprintf(w, "%d dead %s\n", total, plural(total, noun, noun+"s"))
}

// cleanupProgressEvery: how often a running cleanup logs its progress at info.
const cleanupProgressEvery = 10 * time.Second
