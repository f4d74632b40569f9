package outbox_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"unicode"
)

// A newcomer reads the README first: it stays short (the bound),
// the rest is in docs/.
func TestReadmeStaysShort(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(readme), "\n"); n > 250 {
		t.Fatalf("README.md has %d lines, at most 250: move the detail to docs/", n)
	}
}

var mdLink = regexp.MustCompile(`\]\(([^)\s]+)\)`)

// Every relative link of the README and docs/ leads to a file that exists
// and, with a #fragment, to one of its headings.
func TestDocLinksResolve(t *testing.T) {
	t.Parallel()
	files, err := filepath.Glob("docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	bodies := map[string][]byte{} // each linked file read once
	read := func(path string) ([]byte, error) {
		if b, ok := bodies[path]; ok {
			return b, nil
		}
		b, err := os.ReadFile(path)
		if err == nil {
			bodies[path] = b
		}
		return b, err
	}
	for _, doc := range append(files, "README.md", "CHANGELOG.md") {
		text, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range mdLink.FindAllStringSubmatch(string(text), -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			path, frag, _ := strings.Cut(target, "#")
			if path == "" {
				path = doc
			} else {
				path = filepath.Join(filepath.Dir(doc), path)
			}
			body, err := read(path)
			if err != nil {
				t.Errorf("%s links %s: %v", doc, target, err)
				continue
			}
			if frag != "" && strings.HasSuffix(path, ".md") && !hasAnchor(string(body), frag) {
				t.Errorf("%s links %s: %s has no heading with anchor #%s", doc, target, path, frag)
			}
		}
	}
}

// hasAnchor reports whether markdown has a heading whose GitHub anchor is
// frag: lower case, punctuation dropped, spaces as hyphens.
func hasAnchor(markdown, frag string) bool {
	for line := range strings.SplitSeq(markdown, "\n") {
		if !strings.HasPrefix(line, "#") {
			continue
		}
		title := strings.TrimSpace(strings.TrimLeft(line, "#"))
		var b strings.Builder
		for _, r := range strings.ToLower(title) {
			switch {
			case unicode.IsLetter(r) || unicode.IsDigit(r) || r == '-' || r == '_':
				b.WriteRune(r)
			case r == ' ':
				b.WriteByte('-')
			}
		}
		if b.String() == frag {
			return true
		}
	}
	return false
}
