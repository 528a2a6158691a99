// Package testutil is test support shared by rlflow's tests: a Temporal dev
// server per test, the rlflow binary built once per test process, the
// repository's files, free ports and polling. It is imported by _test.go
// files only and is not part of rlflow's API. GPU test support is in
// internal/testutil/gputest.
package testutil

import (
	"context"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
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

// Python3 finds python3 for a test that needs only the standard library
// (what for, in the skip message); without it the test skips, saying so,
// except under CI (CI=true), where .ci/run installs it and its absence is
// a failure.
func Python3(t testing.TB, what string) string {
	t.Helper()
	py, err := exec.LookPath("python3")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("CI needs python3 (for %s): %v", what, err)
		}
		t.Skipf("python3 not on PATH: skipping %s; .ci/run installs it", what)
	}
	return py
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
		Address: "127.0.0.1:" + strconv.Itoa(RebindablePort(t))}
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

// RebindablePort is a free TCP port on 127.0.0.1 outside the kernel's
// ephemeral range (net.ipv4.ip_local_port_range), for a listener that a
// test stops and starts again on the same port: in between, any outgoing
// connection on the host may get an ephemeral port as its source and hold
// it, and the second bind fails with "address already in use". It is also
// below 32768: the Temporal server records its membership ports in
// PostgreSQL as smallints.
func RebindablePort(t testing.TB) int {
	t.Helper()
	lo, hi := 32768, 60999 // Linux's default range
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if a, err1 := strconv.Atoi(f[0]); err1 == nil {
				if b, err2 := strconv.Atoi(f[1]); err2 == nil {
					lo, hi = a, b
				}
			}
		}
	}
	const first, last = 20000, 32767
	var free []int
	for p := first; p <= last; p++ {
		if p < lo || p > hi {
			free = append(free, p)
		}
	}
	if len(free) == 0 {
		t.Fatalf("no loopback port in %d-%d lies outside the ephemeral range %d-%d (net.ipv4.ip_local_port_range)", first, last, lo, hi)
	}
	for range 1000 {
		port := free[rand.IntN(len(free))]
		if l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port)); err == nil {
			l.Close()
			return port
		}
	}
	t.Fatalf("no free loopback port in %d-%d outside the ephemeral range", first, last)
	return 0
}

// FreePort is a TCP port on 127.0.0.1 that was free a moment ago (an
// ephemeral one: see RebindablePort for a listener restarted on it).
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
