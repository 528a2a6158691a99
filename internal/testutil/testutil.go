// Package testutil is test support shared by rlflow's tests: a Temporal dev
// server per test, the rlflow binary built once per test process, the
// repository's files, free ports and polling. It is imported by _test.go
// files only and is not part of rlflow's API. GPU test support is in
// internal/testutil/gputest.
package testutil

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/rlflow/rlflow/devserver"
)

// DevServer starts a headless dev server on a free loopback port for the
// test. Without the Temporal CLI it skips, saying how to get it, except
// under CI (CI=true), where a missing CLI is a failure: CI must never pass
// by skipping. With $RLFLOW_TEST_TEMPORAL set to cluster or cluster-split
// it starts a real cluster instead (StartCluster), whose cleanup stops it:
// the Server it returns then has only its Address.
func DevServer(t testing.TB) *devserver.Server {
	t.Helper()
	if o, ok := clusterFromEnv(t); ok {
		return &devserver.Server{Address: StartCluster(t, o).Address}
	}
	bin := TemporalCLI(t)
	srv, err := devserver.Start(context.Background(), devserver.Options{TemporalPath: bin})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Stop() })
	return srv
}

// TemporalCLI finds the Temporal CLI; without it the test skips, saying
// how to get it, except under CI (CI=true), where that is a failure.
func TemporalCLI(t testing.TB) string {
	t.Helper()
	bin, err := devserver.FindTemporal("")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("CI needs the Temporal CLI: %v", err)
		}
		t.Skipf("needs the Temporal dev server: %v", err)
	}
	return bin
}

// Outage is a dev server that a test can take down and bring back on the
// same address with its state (a database file in the test's temp dir), to
// play a Temporal outage: workflows and their history survive it, as they
// do a real cluster's restart. Under $RLFLOW_TEST_TEMPORAL=cluster (or
// cluster-split) it is a real cluster, which Down SIGKILLs.
type Outage struct {
	t       testing.TB
	bin     string
	db      string
	cluster *Cluster // nil: a dev server
	mu      sync.Mutex
	srv     *devserver.Server
	// Address is the frontend's host:port, the same across restarts.
	Address string
}

// RestartableDevServer starts a dev server that Down and Up can stop and
// restart; it skips (or fails under CI) like DevServer.
func RestartableDevServer(t testing.TB) *Outage {
	t.Helper()
	if o, ok := clusterFromEnv(t); ok {
		c := StartCluster(t, o)
		return &Outage{t: t, cluster: c, Address: c.Address}
	}
	o := &Outage{t: t, bin: TemporalCLI(t), db: filepath.Join(t.TempDir(), "temporal.db"),
		Address: "127.0.0.1:" + strconv.Itoa(FreePort(t))}
	o.Up()
	t.Cleanup(func() { o.Down() })
	return o
}

// Down stops the server (a no-op when it is down).
func (o *Outage) Down() {
	if o.cluster != nil {
		o.cluster.Down()
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.srv != nil {
		_ = o.srv.Stop()
		o.srv = nil
	}
}

// Up starts the server again on the same address and database.
func (o *Outage) Up() {
	o.t.Helper()
	if o.cluster != nil {
		o.cluster.Up()
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.srv != nil {
		return
	}
	srv, err := devserver.Start(context.Background(), devserver.Options{TemporalPath: o.bin, Address: o.Address, DBFile: o.db})
	if err != nil {
		o.t.Fatalf("restarting the dev server: %v", err)
	}
	o.srv = srv
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

// ModuleRoot is the repository root: $RLFLOW_REPO_ROOT, else the nearest
// directory at or above the working directory holding go.mod (a package
// directory under go test, or the root a compiled test binary is started
// from on the GPU host), else the root this file was compiled in.
func ModuleRoot() string {
	if root := os.Getenv("RLFLOW_REPO_ROOT"); root != "" {
		return root
	}
	if dir, err := os.Getwd(); err == nil {
		for {
			if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
				return dir
			}
			parent := filepath.Dir(dir)
			if parent == dir {
				break
			}
			dir = parent
		}
	}
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

// RepoFile is the path of rel in the repository; the test fails when it
// does not exist (set RLFLOW_REPO_ROOT where the search cannot find it).
func RepoFile(t testing.TB, rel string) string {
	t.Helper()
	p := filepath.Join(ModuleRoot(), rel)
	if _, err := os.Stat(p); err != nil {
		t.Fatalf("%s not found in the repository at %s (set RLFLOW_REPO_ROOT): %v", rel, ModuleRoot(), err)
	}
	return p
}

// FreePort is a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// Eventually polls cond every few milliseconds until it holds, failing the
// test with what when timeout passes first.
func Eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
