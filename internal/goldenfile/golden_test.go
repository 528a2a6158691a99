package goldenfile

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// recorder is a testing.TB that keeps its failures.
type recorder struct {
	testing.TB
	failed []string
}

func (r *recorder) Helper()                           {}
func (r *recorder) Errorf(format string, args ...any) { r.failed = append(r.failed, format) }
func (r *recorder) Fatalf(format string, args ...any) { r.failed = append(r.failed, format) }

func TestCheck(t *testing.T) {
	t.Chdir(t.TempDir())
	r := &recorder{TB: t}
	Check(r, "x.golden", "one\n", false, "-update")
	if len(r.failed) != 1 {
		t.Fatalf("a missing file passed: %v", r.failed)
	}
	Check(r, "x.golden", "one\n", true, "-update")
	if b, err := os.ReadFile(filepath.Join("testdata", "x.golden")); err != nil || string(b) != "one\n" {
		t.Fatalf("update wrote %q, %v", b, err)
	}
	r.failed = nil
	Check(r, "x.golden", "one\n", false, "-update")
	Check(r, "x.golden", "two\n", false, "-update")
	if len(r.failed) != 1 || !strings.Contains(r.failed[0], "differs") {
		t.Fatalf("want one difference reported, got %v", r.failed)
	}
}
