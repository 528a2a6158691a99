package e2e

import (
	"os"
	"testing"
)

// TestMain gives the worker processes the tests start a root that holds
// their pipelines: every test keeps its pipelines and data under its own
// t.TempDir(), and a worker's default root, its working directory (this
// package's), holds none of them. TestHostilePaths passes --roots itself.
func TestMain(m *testing.M) {
	if os.Getenv("RLFLOW_ROOTS") == "" {
		os.Setenv("RLFLOW_ROOTS", os.TempDir())
	}
	os.Exit(m.Run())
}
