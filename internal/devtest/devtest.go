// Package devtest starts a Temporal dev server for tests and builds the
// rlflow binary for tests that run it as a separate process.
package devtest

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"

	"github.com/rlflow/rlflow/devserver"
)

// Server starts a headless dev server on a free loopback port for the test.
// Without the Temporal CLI it skips, saying how to get it, except under CI
// (CI=true), where a missing CLI is a failure: CI must never pass by skipping.
func Server(t testing.TB) *devserver.Server {
	t.Helper()
	bin, err := devserver.FindTemporal("")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("CI needs the Temporal CLI: %v", err)
		}
		t.Skipf("needs the Temporal dev server: %v", err)
	}
	srv, err := devserver.Start(context.Background(), devserver.Options{TemporalPath: bin})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Stop() })
	return srv
}

var (
	buildOnce sync.Once
	buildPath string
	buildErr  error
)

// RlflowBinary builds cmd/rlflow once per test process and returns its path.
func RlflowBinary(t testing.TB) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "rlflow-bin-")
		if err != nil {
			buildErr = err
			return
		}
		buildPath = filepath.Join(dir, "rlflow")
		cmd := exec.Command("go", "build", "-o", buildPath, "./cmd/rlflow")
		cmd.Dir = ModuleRoot()
		out, err := cmd.CombinedOutput()
		if err != nil {
			buildErr = err
			t.Logf("%s", out)
		}
	})
	if buildErr != nil {
		t.Fatalf("building rlflow: %v", buildErr)
	}
	return buildPath
}

// ModuleRoot is the repository root (where go.mod is).
func ModuleRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}
