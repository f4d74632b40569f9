package outbox_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tedbank/outbox/partition"
)

// The README's consumer (section "Your own consumer, exactly once in your
// own PostgreSQL") is docs/examples/billing: the README points at it, and it
// passes vet and builds (a newcomer copies it into cmd/billing/main.go);
// TestWalkthroughsRunAsWritten runs the README's block that builds and runs it.
func TestReadmeConsumerCompiles(t *testing.T) {
	const example = "docs/examples/billing/main.go"
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	makefile, err := os.ReadFile("Makefile")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(readme), "("+example+")") || !strings.Contains(string(readme), "bin/billing & billing=$!") ||
		!strings.Contains(string(makefile), "./"+filepath.Dir(example)) {
		t.Fatalf("README.md does not link %s and run it as bin/billing, or make build does not build it (TestWalkthroughsRunAsWritten runs it)", example)
	}
	if _, err := os.Stat(example); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"vet", "./" + filepath.Dir(example)}, {"build", "-o", os.DevNull, "./" + filepath.Dir(example)}} {
		if out, err := exec.Command("go", args...).CombinedOutput(); err != nil {
			t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

// docs/streams.md states the stream names a consumer in another language
// reads: each of its tables is what package partition computes, and what
// the relay writes (partition.Stream is the relay's naming).
func TestDocumentedStreamNames(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("docs/streams.md")
	if err != nil {
		t.Fatal(err)
	}
	rows := 0
	n := 0
	for _, line := range strings.Split(string(doc), "\n") {
		if _, err := fmt.Sscanf(line, "## P = %d", &n); err == nil {
			continue
		}
		var p, slot int
		var tag, stream, state string
		cells := strings.Split(strings.ReplaceAll(line, "`", ""), "|")
		if n == 0 || len(cells) != 7 {
			continue
		}
		if _, err := fmt.Sscanf(strings.Join(cells[1:6], " "), "%d %s %d %s %s", &p, &tag, &slot, &stream, &state); err != nil {
			continue
		}
		rows++
		if got := partition.Tag(p, n); got != tag {
			t.Errorf("P = %d, partition %d: documented tag %s, computed %s", n, p, tag, got)
		}
		if got := partition.Slot(tag); got != slot {
			t.Errorf("P = %d, partition %d: documented slot %d, computed %d", n, p, slot, got)
		}
		if got := partition.Stream("outbox.event.transfer", p, n); got != stream {
			t.Errorf("P = %d, partition %d: documented stream %s, the relay writes %s", n, p, stream, got)
		}
		if got := partition.Prefix("fraud:", p, n); got != state {
			t.Errorf("P = %d, partition %d: documented state prefix %s, computed %s", n, p, state, got)
		}
	}
	if rows != 4+16 {
		t.Fatalf("docs/streams.md: %d table rows read, want 20 (P = 4 and P = 16)", rows)
	}
}
