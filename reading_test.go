package outbox_test

import (
	"bytes"
	"flag"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

var updateReading = flag.Bool("update", false, "rewrite the reading order's counts in docs/development.md")

const (
	readingDoc   = "docs/development.md"
	readingBegin = "<!-- reading order: go test -run TestReadingOrder . -update rewrites the counts -->"
	readingEnd   = "<!-- end of reading order -->"
	// readingTotal is the row that sums the rows above it.
	readingTotal = "| the card's path (1-7) |"
)

var readingFile = regexp.MustCompile("`([^`]+)`")

// The reading order of docs/development.md names real files, and its counts
// are theirs: the table is made by this test (-update), so the lines it
// quotes for the card's path cannot drift from the code.
func TestReadingOrder(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile(readingDoc)
	if err != nil {
		t.Fatal(err)
	}
	text := string(doc)
	begin, end := strings.Index(text, readingBegin), strings.Index(text, readingEnd)
	if begin < 0 || end < begin {
		t.Fatalf("%s has no reading order between %q and %q", readingDoc, readingBegin, readingEnd)
	}
	var out []string
	var pathFiles, pathLines int
	rows := 0
	for _, line := range strings.Split(text[begin:end], "\n") {
		cells := strings.Split(line, "|")
		// | step | files | count | lines |: six cells with the edges.
		if len(cells) != 6 || strings.HasPrefix(line, "| step ") || strings.HasPrefix(line, "|---") {
			out = append(out, line)
			continue
		}
		files, lines := 0, 0
		if strings.HasPrefix(line, readingTotal) {
			files, lines = pathFiles, pathLines
		} else {
			names := readingFile.FindAllStringSubmatch(cells[2], -1)
			if len(names) == 0 {
				t.Fatalf("%s: a row of the reading order names no file: %s", readingDoc, line)
			}
			for _, m := range names {
				b, err := os.ReadFile(m[1])
				if err != nil {
					t.Fatalf("%s's reading order: %v", readingDoc, err)
				}
				files++
				lines += bytes.Count(b, []byte("\n"))
			}
			rows++
			if strings.HasPrefix(cells[1], " ") && len(cells[1]) > 2 && cells[1][1] >= '1' && cells[1][1] <= '7' {
				pathFiles += files
				pathLines += lines
			}
		}
		cells[3], cells[4] = " "+strconv.Itoa(files)+" ", " "+strconv.Itoa(lines)+" "
		out = append(out, strings.Join(cells, "|"))
	}
	if rows < 7 {
		t.Fatalf("%s's reading order has %d rows of files, want the seven steps and more", readingDoc, rows)
	}
	t.Logf("the card's path: %d files, %d lines", pathFiles, pathLines)
	got := text[:begin] + strings.Join(out, "\n") + text[end:]
	if got == text {
		return
	}
	if *updateReading {
		if err := os.WriteFile(readingDoc, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	t.Fatalf("%s's reading order quotes counts the files no longer have (go test -run TestReadingOrder . -update rewrites them)", readingDoc)
}
