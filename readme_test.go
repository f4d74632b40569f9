package outbox_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// The README's consumer (section "Your own consumer, exactly once in your
// own PostgreSQL") compiles and passes vet as printed: a newcomer copies it
// into cmd/billing/main.go.
func TestReadmeConsumerCompiles(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	const marker = "<!-- readme-consumer-example: a test compiles this block -->\n```go\n"
	_, rest, ok := strings.Cut(string(readme), marker)
	if !ok {
		t.Fatal("README.md has no consumer example after its marker")
	}
	code, _, ok := strings.Cut(rest, "\n```\n")
	if !ok {
		t.Fatal("the README's consumer example does not end")
	}
	// Inside the module, as cmd/billing would be; "_" keeps ./... away.
	dir, err := os.MkdirTemp(".", "_readme-consumer-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(code+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"vet", "./" + dir}, {"build", "-o", os.DevNull, "./" + dir}} {
		if out, err := exec.Command("go", args...).CombinedOutput(); err != nil {
			t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}
