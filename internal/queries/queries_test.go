package queries

import (
	"io/fs"
	"strings"
	"testing"
)

// Every file of queries/ has its variable in queries.go, and every variable
// its file.
func TestEveryQueryFileIsLoaded(t *testing.T) {
	files, err := fs.Glob(QueryFS(), "queries/*.sql")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		name := strings.TrimSuffix(strings.TrimPrefix(f, "queries/"), ".sql")
		if Query(name) == "" {
			t.Errorf("queries/%s.sql has no variable in queries.go", name)
		}
	}
	if len(loaded) != len(files) {
		t.Errorf("queries.go loads %d queries, queries/ holds %d files", len(loaded), len(files))
	}
}
