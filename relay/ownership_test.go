package relay

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// The ownership is chosen in ownership.go only (newOwnership, from the
// Config or, for OwnAuto, when Run starts); the rest of the relay asks
// the strategy instead of comparing Config.Ownership: a branch on it
// elsewhere in the code is what this guards against.
func TestOwnershipIsChosenOnlyAtConstruction(t *testing.T) {
	compare := regexp.MustCompile(`Ownership\s*[!=]=|[!=]=\s*Own(Rows|Partitions)\b`)
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	allowed := map[string]bool{"ownership.go": true, "config.go": true} // the choice, the validation
	checked := 0
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		checked++
		if allowed[f] {
			continue
		}
		for i, line := range strings.Split(string(src), "\n") {
			if compare.MatchString(line) && !strings.HasPrefix(strings.TrimSpace(line), "//") {
				t.Errorf("%s:%d branches on the ownership: %s (ask r.own instead)", f, i+1, strings.TrimSpace(line))
			}
		}
	}
	if checked < 10 {
		t.Fatalf("checked %d files", checked)
	}
	if o := newOwnership(&Relay{cfg: Config{Lease: DefaultLease}, pool: &conns{}}, OwnPartitions); o.leases == nil || o.leases.renewEvery() == 0 {
		t.Fatal("partition ownership renews nothing")
	}
}
