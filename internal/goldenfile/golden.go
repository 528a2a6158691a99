// Package goldenfile compares a test's output with a file under testdata and
// rewrites the file on request: the one golden-file check of the tests that
// keep whole outputs (error listings, encodings) in files. It imports
// nothing of rlflow, so any package's tests can use it, internal ones too.
package goldenfile

import (
	"os"
	"path/filepath"
	"testing"
)

// Check compares got with testdata/name, failing t with both when they
// differ; with update it writes got there instead (creating testdata).
// hint says how to rewrite it, for the message when the file is missing.
func Check(t testing.TB, name, got string, update bool, hint string) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if update {
		if err := os.MkdirAll("testdata", 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (%s writes it)", err, hint)
		return
	}
	if string(want) != got {
		t.Errorf("%s differs (%s rewrites it):\n--- got\n%s\n--- want\n%s", path, hint, got, want)
	}
}
